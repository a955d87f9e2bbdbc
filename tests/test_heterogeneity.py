"""System heterogeneity that interacts with label skew (issue 48, item 4): stragglers (clients that
do fewer local steps) and clients that drop out after selection. Both are drawn from named streams
per (seed, round, client), so every executor sees the same; tests/test_vectorized.py's parity list
runs them on both executors and tests/test_lanes.py packed."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from fedskew.config import load_config
from fedskew.engine.protocol import local_budget, stage_schedules
from fedskew.engine.runner import Experiment
from fedskew.streams import dropped_clients, straggler_steps

TINY = ["rounds=3", "partition.num_clients=8", "clients_per_round=6", "local_epochs=2", "batch_size=16",
        "model.hidden=[32,16]", "final_personalization=false"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (tests/conftest.py)


def test_dropout_draws_each_client_with_its_probability_and_always_leaves_one():
    selected = list(range(10))
    counts = [len(dropped_clients(3, t, selected, 0.3)) for t in range(400)]
    assert abs(np.mean(counts) / 10 - 0.3) < 0.02
    assert dropped_clients(3, 7, selected, 0.3) == dropped_clients(3, 7, selected, 0.3)  # seeded
    assert dropped_clients(3, 7, selected, 0.0) == []
    # a client's fate depends on (seed, round, client) only, not on who else was selected
    both = dropped_clients(3, 7, [2, 5], 0.5)
    assert [k for k in dropped_clients(3, 7, selected, 0.5) if k in (2, 5)] == both or len(both) == 1
    assert all(len(dropped_clients(1, t, selected, 0.99)) == 9 for t in range(20))  # one always stays


def test_a_straggler_does_uniformly_fewer_steps_and_the_others_their_budget():
    draws = [straggler_steps(0, t, k, 0.4, 20) for t in range(50) for k in range(10)]
    cut = [d for d in draws if d < 20]
    assert abs(len(cut) / len(draws) - 0.4) < 0.05
    assert min(cut) >= 1 and max(cut) <= 19 and len(set(cut)) > 12  # 1 .. 19, uniformly
    assert straggler_steps(0, 1, 2, 1.0, 1) == 1  # a single step cannot be cut
    assert straggler_steps(0, 1, 2, 0.0, 20) == 20


def test_the_final_personalisation_pass_never_straggles():
    exp = Experiment(load_config(None, TINY + ["stragglers=1.0"]), run_dir=None)
    s = exp.executor.settings
    for k in range(8):
        n = len(exp.fed.train_idx[k])
        full, done = local_budget(s, exp.method, 0, k, n)
        assert done < full
        assert local_budget(s, exp.method, 3, k, n) == (full, full)  # round `rounds`: the final pass
        assert len(stage_schedules(s, exp.method, 0, k, n, 0.01)[0]) == done


def spy(monkeypatch, exp) -> list:
    """What the run's aggregation receives each round: {client: (upload, report)}."""
    seen = []
    aggregate = exp.method.aggregate

    def recording(server_state, global_state, uploads, reports):
        seen.append({r.client_id: (u, r) for u, r in zip(uploads, reports)})
        return aggregate(server_state, global_state, uploads, reports)
    monkeypatch.setattr(exp.method, "aggregate", recording)
    return seen


def test_dropped_clients_are_left_out_and_the_others_train_as_without_dropout(tmp_path, monkeypatch):
    """Round 1 (from the same global model): the clients that stay upload bit for bit what they upload
    in a run without dropout; the dropped ones upload nothing, are recorded, and their download is
    counted (they received the model). (The sequential executor: stacked, another set of clients
    rounds differently.)"""
    plain = Experiment(load_config(None, TINY + ["rounds=1", "executor=sequential"]), tmp_path / "plain")
    seen_plain = spy(monkeypatch, plain)
    res_plain = plain.run()
    drop = Experiment(load_config(None, TINY + ["rounds=1", "client_dropout=0.4", "executor=sequential"]),
                      tmp_path / "drop")
    seen_drop = spy(monkeypatch, drop)
    res = drop.run()
    record = res.history[0]
    dropped = dropped_clients(0, 0, record["clients"], 0.4)
    assert record["clients_dropped"] == dropped and dropped, record
    assert sorted(seen_drop[0]) == sorted(set(record["clients"]) - set(dropped))
    for k, (upload, _) in seen_drop[0].items():
        assert all(torch.equal(v, seen_plain[0][k][0][n]) for n, v in upload.items()), k
    assert record["comm/down_floats"] == res_plain.history[0]["comm/down_floats"]
    assert record["comm/up_floats"] < res_plain.history[0]["comm/up_floats"]
    assert "clients_straggling" not in record and "clients_dropped" not in res_plain.history[0]


def test_stragglers_report_the_steps_they_did_and_are_recorded(tmp_path, monkeypatch):
    exp = Experiment(load_config(None, TINY + ["stragglers=0.5", "method=fednova"]), tmp_path / "r")
    seen = spy(monkeypatch, exp)
    res = exp.run()
    s = exp.executor.settings
    cut_any = False
    for t, (record, reports) in enumerate(zip(res.history, seen)):
        for k, (_, report) in reports.items():
            full, done = local_budget(s, exp.method, t, k, len(exp.fed.train_idx[k]))
            assert report.num_steps == done  # (FedNova normalises by each client's own steps)
            assert (done < full) == (k in record["clients_straggling"])
            cut_any |= done < full
    assert cut_any


@pytest.mark.parametrize("args, text", [
    (["stragglers=1.5"], "config key 'stragglers' = 1.5 is not allowed: Input should be less than or equal to 1"),
    (["client_dropout=1"], "config key 'client_dropout' = 1 is not allowed: Input should be less than 1"),
    (["client_dropout=-0.1"], "config key 'client_dropout' = -0.1 is not allowed: Input should be greater than or "
                              "equal to 0"),
])
def test_a_fraction_outside_its_range_is_one_sentence_exit_2_and_writes_nothing(tmp_path, args, text):
    out = subprocess.run([sys.executable, "-m", "fedskew.cli", "run", *args, "rounds=1", f"out_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert text in out.stderr, out.stderr
    assert not any(tmp_path.iterdir())


# -- clients never trained on (issue 48, item 1) -----------------------------------------------------

HELD = TINY + ["partition.num_clients=10", "clients_per_round=4", "partition.held_out=0.3",
               "final_personalization=true"]


def test_held_out_clients_never_train_and_are_scored_apart(tmp_path):
    """round(0.3 * 10) = 3 clients drawn from the seed never train; the final pass scores the final
    global model on their local test splits (unseen/final_acc_before, checked here by predicting
    with the final model) and what the method's personalisation gives them (unseen/final_acc_after);
    personal/final_* covers the others."""
    from fedskew.models.functional import predict
    from fedskew.streams import held_out_clients

    exp = Experiment(load_config(None, HELD + ["rounds=4"]), tmp_path / "r")
    res = exp.run()
    held = held_out_clients(0, 10, 0.3)
    assert len(held) == 3 and res.summary["unseen/clients"] == held == exp.held_out
    assert not set(held) & {k for h in res.history for k in h["clients"]}
    assert len(res.summary["personal/final_acc_after_per_client"]) == 7
    assert len(res.summary["unseen/final_acc_after_per_client"]) == 3
    fed = exp.fed
    accs = []
    for k in held:
        idx = fed.test_idx[k]
        accs.append((predict(res.model, res.global_state, fed.data.x_train[idx]) == fed.data.y_train[idx])
                    .float().mean().item())
    assert res.summary["unseen/final_acc_before_per_client"] == pytest.approx(accs, abs=1e-6)
    assert res.summary["unseen/final_acc_before"] == pytest.approx(np.mean(accs), abs=1e-6)
    # a local pass from the final model on a new client's own data beats the global model there
    assert res.summary["unseen/final_acc_after"] > res.summary["unseen/final_acc_before"]


def test_without_held_out_clients_the_run_is_the_run_it_was():
    """held_out = 0: the same selection as before the option existed (every client a candidate)."""
    from fedskew.streams import sample_clients

    exp = Experiment(load_config(None, TINY), run_dir=None)
    assert exp.training_clients == list(range(8)) and exp.held_out == []
    assert [exp.training_clients[i] for i in sample_clients(0, 5, 8, 6)] == sample_clients(0, 5, 8, 6)


@pytest.mark.parametrize("args, text", [
    (["partition.held_out=0.01"], "partition.held_out = 0.01 of 10 clients holds out none; raise it to at least 0.05"),
    (["partition.held_out=0.7"], "partition.held_out = 0.7 holds out 7 of 10 clients, leaving 3 to train, fewer than "
                                 "clients_per_round = 4"),
    (["partition.held_out=0.3", "final_personalization=false"], "partition.held_out needs final_personalization = "
                                                                "true and partition.local_test_fraction > 0"),
])
def test_held_out_settings_that_cannot_work_are_one_sentence(tmp_path, args, text):
    base = [a for a in HELD if not a.startswith(("partition.held_out", "final_personalization"))]
    out = subprocess.run([sys.executable, "-m", "fedskew.cli", "run", *base, *args, f"out_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert text in out.stderr, out.stderr
    assert not any(tmp_path.iterdir())


def test_both_executors_score_held_out_clients_alike(tmp_path):
    from fedskew.engine.runner import run

    a, b = (run(load_config(None, HELD + ["method=fedrep", f"executor={ex}"]), tmp_path / ex)
            for ex in ("sequential", "vectorized"))
    for key in ("unseen/final_acc_before_per_client", "unseen/final_acc_after_per_client",
                "personal/final_acc_after_per_client"):
        assert a.summary[key] == pytest.approx(b.summary[key], abs=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(__import__("fedskew.algorithms", fromlist=["METHODS"]).METHODS))
def test_every_method_scores_clients_it_never_trained(tmp_path, name):
    """The final pass stacks clients that trained with clients that never did (the held-out ones):
    a method whose client state gains keys in training fails here (pFedFDA's personal head did in
    the lite bench's unseen setting); every method reports unseen/final_acc_after."""
    args = [a for a in HELD if not a.startswith(("rounds", "local_epochs"))] + ["rounds=2", "local_epochs=1",
                                                                                f"method={name}",
                                                                                "executor=vectorized"]
    res = Experiment(load_config(None, args), tmp_path / name).run()
    assert res.summary["unseen/clients"] and res.summary["unseen/final_acc_after"] is not None
