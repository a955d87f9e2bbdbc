import json

import pytest
import torch

from fedskew.cli import main
from fedskew.config import load_config
from fedskew.engine.resume import resume
from fedskew.engine.runner import Experiment, run
from fedskew.streams import sample_clients

SMALL = ["rounds=4", "partition.num_clients=8", "clients_per_round=3", "local_epochs=1", "model.hidden=[32]",
         "final_personalization=false"]


def test_client_schedule_depends_on_seed_and_round_only():
    a = [sample_clients(3, t, 100, 10) for t in range(5)]
    assert a == [sample_clients(3, t, 100, 10) for t in range(5)]
    assert a[0] != a[1] and len(set(a[0])) == 10
    assert sample_clients(4, 0, 100, 10) != a[0]


def test_two_methods_under_one_seed_sample_the_same_clients(tmp_path):
    h1 = run(load_config(None, SMALL + ["method.weighting=samples"]), tmp_path / "a").history
    h2 = run(load_config(None, SMALL + ["method.weighting=uniform"]), tmp_path / "b").history
    assert [h["clients"] for h in h1] == [h["clients"] for h in h2]
    assert h1[-1]["global/test_acc"] != h2[-1]["global/test_acc"] or h1[-1]["train/loss"] != h2[-1]["train/loss"]


def test_run_is_repeatable_and_writes_its_directory(tmp_path):
    cfg = load_config(None, SMALL + ["final_personalization=true"])
    r1 = run(cfg, tmp_path / "r1")
    r2 = run(cfg, tmp_path / "r2")
    assert all(torch.equal(r1.global_state[k], r2.global_state[k]) for k in r1.global_state)
    for f in ("config.yaml", "metrics.jsonl", "summary.json", "partition.png", "partition.json", "checkpoint.pt"):
        assert (tmp_path / "r1" / f).is_file(), f
    lines = (tmp_path / "r1" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4
    s = json.loads((tmp_path / "r1" / "summary.json").read_text())
    assert 0 <= s["global/test_acc"] <= 1 and "personal/final_acc_after" in s
    assert "fedskew_version: 0.1.0" in (tmp_path / "r1" / "config.yaml").read_text()


def test_comm_is_counted_from_the_tensors_sent(tmp_path):
    res = run(load_config(None, SMALL), tmp_path)
    numel = sum(v.numel() for v in res.global_state.values())
    assert numel == 64 * 32 + 32 + 32 * 10 + 10
    h = res.history[0]
    assert h["comm/down_floats"] == 3 * numel and h["comm/up_floats"] == 3 * numel
    assert res.history[-1]["comm/down_floats_total"] == 4 * 3 * numel


def test_interrupted_run_resumes_exactly(tmp_path):
    cfg = load_config(None, SMALL + ["model=cnnbn", "model.width=4"])
    full = run(cfg, tmp_path / "full")

    def crash(record):
        if record["round"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Experiment(cfg, tmp_path / "cut").run(crash)
    assert len((tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()) == 2
    resumed = resume(tmp_path / "cut")
    assert len(resumed.history) == 4
    for k in full.global_state:
        assert torch.equal(full.global_state[k], resumed.global_state[k]), k
    assert resumed.summary["global/test_acc"] == full.summary["global/test_acc"]


def test_divergence_stops_with_a_clear_message(tmp_path):
    cfg = load_config(None, SMALL + ["lr=1e6", "momentum=0"])
    with pytest.raises(
        FloatingPointError,
        match=r"round 1: (client \d+.s local loss is (nan|inf)|the aggregated model holds NaN or inf)",
    ):
        run(cfg, tmp_path)
    assert (tmp_path / "config.yaml").exists()


def test_cli_run_and_errors(tmp_path, capsys):
    assert main(["run", *SMALL, f"out_dir={tmp_path}", "run_name=cli"]) == 0
    out = capsys.readouterr().out
    assert "global/test_acc" in out and (tmp_path / "cli" / "summary.json").exists()
    assert main(["run", "partition.classes_per_client=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedskew: error: config key 'partition.classes_per_client' = 0") and err.count("\n") == 1
    assert main(["partition", "partition.num_clients=5", "clients_per_round=5", "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert main(["run", "partition.num_clients=3", "clients_per_round=3", "partition.classes_per_client=2"]) == 2
    assert "fewer than the 10 classes" in capsys.readouterr().err


@pytest.mark.parametrize("extra, want", [
    ([], "vectorized"),  # the digits MLP: the faster executor
    (["method=fedcp"], "sequential"),  # a method that does not vectorise (Gumbel noise)
    (["model=tcnn", "batch_size=64"], "sequential"),  # CPU convolutions of batches of 32 or more
    (["model=tcnn", "batch_size=16"], "vectorized"),
    (["channels_last=on"], "sequential"),  # the sequential executor's layout
    (["clients_per_round=1"], "sequential"),  # nothing to stack
    (["executor=sequential"], "sequential"),  # as named
])
def test_the_auto_executor_follows_the_configuration(extra, want):
    from fedskew.engine.local import SequentialExecutor
    from fedskew.engine.vectorized import VectorizedExecutor

    exp = Experiment(load_config(None, SMALL + extra))
    assert exp.environment["executor"] == want
    assert type(exp.executor) is {"vectorized": VectorizedExecutor, "sequential": SequentialExecutor}[want]


def test_compile_and_channels_last_cannot_both_be_on():
    from fedskew.config import ConfigError

    with pytest.raises(ConfigError, match="ask for different executors"):
        load_config(None, ["compile=on", "channels_last=on"])
