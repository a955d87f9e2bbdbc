"""Experiment tracking: TensorBoard event files, W&B offline runs and an MLflow SQLite store hold
exactly what metrics.jsonl holds (read back with each tool's own reader)."""

import glob
import json
import struct
from pathlib import Path

import pytest

import fedskew
from fedskew.config import ConfigError
from fedskew.engine.tracking import scalars

SMALL = {"rounds": 3, "partition.num_clients": 6, "clients_per_round": 3, "local_epochs": 1, "model.hidden": [16],
         "final_personalization": False}
KEYS = ("global/test_acc", "train/loss", "personal/acc_after", "comm/up_floats")


def jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files_hold_the_records(tmp_path):
    pytest.importorskip("tensorboard")
    res = fedskew.run(SMALL, logger="tensorboard", out_dir=str(tmp_path), run_name="tb")
    events = tensorboard_scalars(res.run_dir)
    records = jsonl(res.run_dir)
    assert set(events) == {k for r in records for k in scalars(r)}
    for key in KEYS:
        assert [s for s, _ in events[key]] == [r["round"] for r in records]
        assert [v for _, v in events[key]] == pytest.approx([r[key] for r in records], rel=1e-6)


def test_a_resumed_run_leaves_one_point_per_round(tmp_path):
    pytest.importorskip("tensorboard")

    def crash(record):
        if record["round"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fedskew.run(SMALL, logger=["tensorboard"], out_dir=str(tmp_path), run_name="r", on_round=crash)
    # the crashed run logged round 1 after its checkpoint: the resumed one replaces it
    fedskew.resume(tmp_path / "r")
    events = tensorboard_scalars(tmp_path / "r")
    assert [s for s, _ in events["global/test_acc"]] == [0, 1, 2]
    assert [v for _, v in events["global/test_acc"]] == pytest.approx(
        [r["global/test_acc"] for r in jsonl(tmp_path / "r")], rel=1e-6)


def wandb_history(run_dir: Path) -> list[dict]:
    """The history records of a W&B offline run, from its ``.wandb`` file (LevelDB-style log of
    Record protobufs: 32 KiB blocks, 7-byte chunk headers, after a 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))[0]).read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, out, block = 7, b"", [], 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                out.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return out


KILLER = """
import os, signal, sys
import fedskew
from fedskew.engine.rundir import RunDir

real, after = RunDir.checkpoint, sys.argv[2] == "after"

def checkpoint(self, state):  # SIGKILL at round 2's checkpoint: just before it or just after it
    if after:
        real(self, state)
    if state["next_round"] == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    real(self, state)

RunDir.checkpoint = checkpoint
fedskew.run({**eval(sys.argv[3]), "logger": ["tensorboard", "mlflow"]}, out_dir=sys.argv[1], run_name="k")
"""


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
@pytest.mark.parametrize("when", ["before", "after"])
def test_sigkill_around_the_checkpoint_loses_no_tracked_round(tmp_path, when):
    """Killed just after the checkpoint (the trackers had not seen the round yet) or just before it
    (they had, and the round runs again): after the resume TensorBoard and MLflow hold every round
    once, with metrics.jsonl's values."""
    import subprocess
    import sys

    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    # (a folder named by the case: pytest hands the second case the first one's tmp_path again once that
    # passed and was removed, and MLflow keeps its store of a database path for the life of the process: a
    # new file at the old path is "a readonly database" to it)
    out = tmp_path / when
    cfg = {**SMALL, "rounds": 4}
    proc = subprocess.run([sys.executable, "-c", KILLER, str(out), when, repr(cfg)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    fedskew.resume(out / "k")
    records = jsonl(out / "k")
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    events = tensorboard_scalars(out / "k")
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("fedskew").experiment_id])
    for key in KEYS:
        assert events[key] == [(r["round"], pytest.approx(r[key], rel=1e-6)) for r in records]
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == [(r["round"], pytest.approx(r[key], rel=1e-12))
                                                        for r in records]


def test_wandb_offline_run_holds_the_records(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline by default
    res = fedskew.run(SMALL, logger=["wandb"], out_dir=str(tmp_path), run_name="wb")
    # run.finish() returns before W&B's service process has flushed the transaction log to disk
    # (a CI run on a loaded 2-core machine read it with no history records yet); teardown waits
    # for the service to finish, as the atexit hook does at the end of a real process.
    import wandb

    wandb.teardown()
    history = wandb_history(res.run_dir)
    records = jsonl(res.run_dir)
    assert [h["_step"] for h in history] == [r["round"] for r in records]
    for key in KEYS:
        assert [h[key] for h in history] == pytest.approx([r[key] for r in records], rel=1e-9)


def test_mlflow_store_holds_the_records_and_groups_a_sweep(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from mlflow import MlflowClient

    res = fedskew.run(SMALL, logger=["mlflow"], out_dir=str(tmp_path), run_name="ml")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("fedskew").experiment_id])
    assert run.info.run_name == "ml" and run.info.status == "FINISHED"
    assert run.data.params["method.name"] == "fedavg" and run.data.params["rounds"] == "3"
    records = jsonl(res.run_dir)
    for key in KEYS:
        history = client.get_metric_history(run.info.run_id, key)
        assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == \
            [(r["round"], pytest.approx(r[key], rel=1e-12)) for r in records]

    spec = {"name": "grouped", "base": {**SMALL, "logger": ["mlflow"]}, "methods": ["fedavg", "fedprox"],
            "seeds": [0, 1]}
    sweep_dir = fedskew.sweep(spec, jobs=1, out=tmp_path / "sweep")
    client = MlflowClient(tracking_uri=f"sqlite:///{sweep_dir / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("grouped").experiment_id])
    assert len(runs) == 4 and {r.data.params["method.name"] for r in runs} == {"fedavg", "fedprox"}
    # where a run is logged is not part of its identity: the same sweep without loggers is all done
    events = []
    fedskew.sweep({**spec, "base": SMALL}, jobs=1, out=tmp_path / "sweep", on_event=lambda k, r: events.append(k))
    assert events == ["skipped"] * 4


def test_a_missing_tracker_package_is_one_sentence(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"config key 'logger' = 'wandb' needs the wandb package: "
                                          r"pip install 'fedskew\[wandb\]'"):
        fedskew.run(SMALL, logger="wandb", out_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="config key 'logger.0' = 'tensorbaord' is not allowed"):
        fedskew.run(SMALL, logger="tensorbaord", out_dir=str(tmp_path))
