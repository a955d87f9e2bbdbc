"""Reliability: exact resume after SIGKILL (real subprocesses), checkpoint corruption, failing
clients, divergence, and property-based input fuzzing (issue: reliability)."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedskew.algorithms import METHODS, Method
from fedskew.config import ConfigError, load_config
from fedskew.data import DatasetError, PartitionError
from fedskew.engine.resume import resume
from fedskew.engine.runner import ClientFailure, Experiment, run
from fedskew.models import ModelError

SMALL = ["rounds=8", "partition.num_clients=10", "clients_per_round=5", "local_epochs=2", "batch_size=16",
         "final_personalization=false"]


def _cli(*args):
    return [sys.executable, "-m", "fedskew.cli", *args]


def _strip(history):
    return [{k: v for k, v in h.items() if not k.startswith("time/")} for h in history]


@pytest.mark.slow  # a run process killed
@pytest.mark.parametrize("extra", [
    ["method=fedavg", "executor=sequential"],
    ["method=map", "model.classifier_bias=false", "executor=vectorized"],   # per-client HPMs
    ["method=scaffold", "executor=sequential", "checkpoint_every=2"],        # control variates, sparse checkpoints
])
def test_sigkill_then_resume_is_bit_identical(tmp_path, extra):
    ref = run(load_config(None, SMALL + extra), tmp_path / "ref")
    kill_at = random.Random(" ".join(extra)).randint(1, 5)  # a random round, reproducible per case
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(_cli("run", *SMALL, *extra, f"out_dir={tmp_path}", "run_name=killed"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_at:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-500:]
    done = len([line for line in metrics.read_text().splitlines() if line.strip()])
    assert done < 8, "the run finished before it could be killed"

    out = subprocess.run(_cli("resume", str(run_dir)), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-1000:]
    final = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert final["next_round"] == 8
    for k, v in ref.global_state.items():
        assert torch.equal(final["global_state"][k], v), k
    history = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert _strip(history) == _strip(ref.history)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {k: v for k, v in summary.items() if not k.startswith("time/")} == \
        {k: v for k, v in ref.summary.items() if not k.startswith("time/")}


def test_corrupt_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    cfg = SMALL[1:] + ["rounds=3"]
    ref = run(load_config(None, cfg), tmp_path / "ref")
    broken = tmp_path / "broken"
    run(load_config(None, cfg), broken)
    data = (broken / "checkpoint.pt").read_bytes()
    (broken / "checkpoint.pt").write_bytes(data[: len(data) // 2])  # truncated
    res = resume(broken)
    assert "trying the previous checkpoint" in capsys.readouterr().out
    for k, v in ref.global_state.items():
        assert torch.equal(res.global_state[k], v), k
    assert len(res.history) == 3
    (broken / "checkpoint.pt").write_bytes(b"garbage")
    (broken / "checkpoint.prev.pt").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="no readable checkpoint") as err:
        resume(broken)
    assert "\n" not in str(err.value)


class FailingClient(Method):
    """FedAvg whose client 1 raises while preparing (a broken device, corrupt local data, ...)."""

    name = "failing_client"

    def prepare(self, payload, client_state, data):
        if data.client_id == 1:
            raise RuntimeError("client 1: local storage unreadable")
        return client_state


def test_a_failing_client_is_reported_and_left_out(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(METHODS, FailingClient.name, FailingClient)
    base = ["rounds=2", "partition.num_clients=4", "clients_per_round=4", "local_epochs=1",
            "final_personalization=false", "method=failing_client"]
    states = {}
    for executor in ("sequential", "vectorized"):
        exp = Experiment(load_config(None, base + [f"executor={executor}"]), tmp_path / executor)
        res = exp.run()
        assert [h["clients_failed"] for h in res.history] == \
            [[{"client": 1, "error": "RuntimeError: client 1: local storage unreadable"}]] * 2
        assert "client 1 failed and is left out" in capsys.readouterr().out
        model_floats = sum(v.numel() for v in res.global_state.values())
        assert res.history[0]["comm/up_floats"] == 3 * model_floats  # three uploads aggregated
        assert res.history[0]["comm/down_floats"] == 4 * model_floats  # all four received the model
        states[executor] = res.global_state
        if executor == "vectorized":
            assert exp.executor.fallback_reason is None  # a failing client is not a vmap problem
    for k in states["sequential"]:
        assert torch.allclose(states["sequential"][k], states["vectorized"][k], atol=1e-6), k
    with pytest.raises(RuntimeError, match="local storage unreadable"):
        run(load_config(None, base + ["fail_fast=true"]), tmp_path / "ff")


def test_every_client_failing_stops_with_one_sentence(tmp_path, monkeypatch):
    class AllFail(Method):
        name = "all_fail"

        def prepare(self, payload, client_state, data):
            raise OSError("disk gone")

    monkeypatch.setitem(METHODS, AllFail.name, AllFail)
    with pytest.raises(ClientFailure, match="round 1: every selected client failed; the first error was OSError"):
        run(load_config(None, SMALL + ["method=all_fail"]), tmp_path)


def test_exploding_learning_rate_stops_naming_round_and_client(tmp_path):
    """Two good rounds, then the run is resumed with lr raised to 1e4 in its config.yaml: round 2
    diverges, the error names it, and the checkpoint after round 1 stays the newest."""
    run(load_config(None, SMALL + ["rounds=2"]), tmp_path)
    text = (tmp_path / "config.yaml").read_text()
    (tmp_path / "config.yaml").write_text(text.replace("rounds: 2", "rounds: 4").replace("lr: 0.01", "lr: 10000.0"))
    assert "lr: 10000.0" in (tmp_path / "config.yaml").read_text()
    with pytest.raises(FloatingPointError, match=r"round 3: (client \d+'s local loss|the aggregated model)") as err:
        resume(tmp_path)
    assert "\n" not in str(err.value)
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["next_round"] == 2


# -- fuzzing: every input runs or fails with one sentence ---------------------------------------

EXPECTED = (ConfigError, PartitionError, ModelError, DatasetError, FloatingPointError, ClientFailure)

# Every field valid except at most one (``corrupt``), so that runs happen as well as refusals.
VALID = {
    "partition": st.sampled_from(["iid", "pcdd", "label_k", "dirichlet", "random_classes", "label_count"]),
    "partition.num_clients": st.integers(1, 60),
    "partition.classes_per_client": st.integers(1, 10),
    "partition.alpha": st.sampled_from(["0.1", "0.5", "5", "1e-3"]),
    "partition.samples_per_class": st.integers(1, 200),
    "partition.local_test_fraction": st.sampled_from(["0", "0.2", "0.5"]),
    "clients_per_round": st.integers(1, 40),
    "model": st.sampled_from(["mlp", "lenet", "cnnbn", "tcnn"]),
    "model.classifier": st.sampled_from(["linear", "etf"]),
    "batch_size": st.integers(1, 64),
    "lr": st.sampled_from(["0.05", "0.01", "1e9"]),
    "method": st.sampled_from(["fedavg", "fedmr", "map", "fedka", "etf_gmv", "scaffold", "fedaws", "fedntd"]),
    "dataset": st.sampled_from(["digits", "synthetic"]),
}
INVALID = {
    "partition": st.just("bogus"), "partition.num_clients": st.sampled_from(["0", "-3", "5000", "two"]),
    "partition.classes_per_client": st.sampled_from(["0", "11", "50"]),
    "partition.alpha": st.sampled_from(["0", "-1", "nan", "inf"]),
    "partition.samples_per_class": st.sampled_from(["0", "100000"]),
    "partition.local_test_fraction": st.sampled_from(["1", "-0.1", "0.999"]),
    "clients_per_round": st.sampled_from(["0", "1000"]), "model": st.just("resnet"),
    "model.classifier": st.just("cosine"), "batch_size": st.sampled_from(["0", "-5"]),
    "lr": st.sampled_from(["0", "-1", "abc"]), "method": st.just("nope"), "dataset": st.just("imagenet"),
}


@st.composite
def overrides(draw):
    values = {k: draw(v) for k, v in VALID.items()}
    values["clients_per_round"] = draw(st.integers(1, values["partition.num_clients"]))
    corrupt = draw(st.sampled_from([None, None, None, *INVALID]))
    if corrupt is not None:
        values[corrupt] = draw(INVALID[corrupt])
    return values


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(overrides())
def test_fuzzed_inputs_run_or_fail_with_one_sentence(tmp_path_factory, values):
    items = [f"{k}={v}" for k, v in values.items()] + ["rounds=1", "local_epochs=1", "final_personalization=false"]
    try:
        cfg = load_config(None, items)
        run(cfg, tmp_path_factory.mktemp("fuzz"))
    except EXPECTED as exc:
        message = str(exc)
        assert message and "\n" not in message and "Traceback" not in message, message
