"""Runs as lanes (src/fedskew/engine/lanes.py): runs packed into one stacked program give what each run
gives alone, to float round-off; a failing run leaves the pack; sweeps pack, resume and refuse bad
input like unpacked ones.

Tolerance: as tests/test_vectorized.py's (its module docstring): 1e-5 on every parameter after the case's rounds, or,
where the case amplifies round-off past it, within twice what a 1e-6 relative change of the learning rate (either way)
does to the run alone, and below 1e-2 (FedMR's paper-form intra term moves its seed-1 run 7e-3 for that change within
one round, measured). What differs between a packed run and the same run alone is only how the stacked kernels group
their reductions (more lanes in one batched call) and, when the runs of a pack differ in learning rate, the update p -
lr * buf written as a product and a subtraction instead of torch's fused kernel: float round-off either way.
"""

import json
import os
import signal
import subprocess
import sys
import time
import weakref

import pytest
import torch
import yaml

from fedskew.algorithms import METHODS, Method, build_method
from fedskew.config import load_config
from fedskew.engine.lanes import Pack, lane_option_plan
from fedskew.engine.runner import Experiment
from fedskew.experiments.sweep import pack_key, packs
from test_vectorized import BASE, PARITY, TOL, base_for, max_difference

VEC = BASE + ["executor=vectorized"]


def vec(extra: list[str]) -> list[str]:
    return base_for(extra) + ["executor=vectorized"]


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def other_run(extra: list[str]) -> list[str]:
    """The second run of a pack: another seed, another learning rate, and every float method option
    the case sets changed by half."""
    changed = []
    for item in extra:
        key, _, value = item.partition("=")
        if key.startswith("method.") and any(c in value for c in ".e") and _is_float(value):
            changed.append(f"{key}={float(value) * 1.5!r}")
    return extra + ["seed=1", "lr=0.015", *changed]


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def alone(tmp_path, extra, name, lr_factor=None):
    cfg = load_config(None, vec(extra) + extra)
    if lr_factor is not None:
        cfg = load_config(None, vec(extra) + extra + [f"lr={cfg.lr * lr_factor!r}"])
    return Experiment(cfg, tmp_path / name).run()


def packed(tmp_path, configs: list[list[str]], **kw):
    pack = Pack(**kw)
    experiments = [Experiment(load_config(None, vec(extra) + extra), tmp_path / f"packed{i}", pack=pack)
                   for i, extra in enumerate(configs)]
    return pack, pack.run(experiments)


def as_alone(tmp_path, extra, name, got, ref) -> str | None:
    """None when ``got`` (packed) equals ``ref`` (alone) to TOL, or within twice the run's
    sensitivity (a 1e-6 relative change of lr, either way) and below 1e-3; else why not. "chaotic"
    when the run's own sensitivity passes 1e-3: no comparison after its rounds can tell a fault
    from amplified round-off."""
    assert not isinstance(got, BaseException), got
    diff, key = max_difference(ref, got)
    if diff > TOL:
        sensitivity = max(
            max_difference(ref, alone(tmp_path, extra, f"{name}-nudged{f}", 1 + f))[0] for f in (1e-6, -1e-6)
        )
        if sensitivity > 1e-3:
            return "chaotic"
        if diff > 2 * sensitivity:
            return (
                f"{key}: packed and alone differ by {diff:.3g}; a 1e-6 change of lr moves the run by {sensitivity:.3g}"
            )
    else:
        for ha, hb in zip(ref.history, got.history):  # (where the dynamics are tame, the records agree too)
            assert ha["train/loss"] == pytest.approx(hb["train/loss"], rel=1e-5, abs=1e-5)
    for ha, hb in zip(ref.history, got.history):
        assert ha["clients"] == hb["clients"] and ha["comm/up_floats"] == hb["comm/up_floats"]
    return None


def assert_as_alone(tmp_path, extra, name, got, ref):
    verdict = as_alone(tmp_path, extra, name, got, ref)
    assert verdict is None, verdict


def packed_as_alone(tmp_path, extra):
    """``extra`` and :func:`other_run` of it packed, each as it is alone; a pair that amplifies
    round-off past 1e-3 is compared again after one round, then one round of one epoch. The pack,
    its results and the rounds keys it was compared at. Also tests/test_gpu.py's, on CUDA."""
    for rounds in ([], ["rounds=1"], ["rounds=1", "local_epochs=1"]):
        cases = [extra + rounds, other_run(extra) + rounds]
        where = tmp_path / f"r{len(rounds)}"
        pack, results = packed(where, cases)
        verdicts = [as_alone(where, cfg, f"alone{i}", results[i], alone(where, cfg, f"alone{i}"))
                    for i, cfg in enumerate(cases)]
        if "chaotic" not in verdicts:
            break
    assert verdicts == [None, None], verdicts
    return pack, results, rounds


@pytest.mark.parametrize("extra", PARITY)
def test_packed_runs_equal_each_run_alone(tmp_path, extra):
    """Every parity case of tests/test_vectorized.py (every vectorisable method): two runs differing
    in seed, learning rate and float options, packed, each as it is alone. A run that amplifies
    round-off past 1e-3 within the case's rounds (FedMR's paper-form intra term: a 1e-6 change of lr
    moves its seed-1 run by 0.06 after two rounds and 7e-3 after one; FedDBE's BatchNorm case by
    0.03 after three, measured) is compared again after one round, then after one round of one
    epoch."""
    pack, results, rounds = packed_as_alone(tmp_path, extra)
    # the runs really trained side by side (no more stacked calls than one run alone makes: a stage
    # per round and chunk), except where a method's loss branches on an option's value (then one
    # call per run, as the notice says)
    if pack.merge:
        cfg = load_config(None, vec(extra) + extra + rounds)
        chunks = -(-cfg.clients_per_round // (cfg.max_parallel_clients or cfg.clients_per_round))
        assert pack.calls <= max(len(r.history) for r in results) * 2 * chunks + 1
    else:
        assert "data-dependent control flow" in pack.reason or "differs from its run alone" in pack.reason


def test_float_options_become_lane_tensors_and_other_options_split_packs():
    info = Experiment(load_config(None, VEC)).info
    a, b = (build_method(load_config(None, VEC + ["method=fedprox", f"method.mu={mu}"]).method, info)
            for mu in (0.1, 0.3))
    assert lane_option_plan([a, b]) == {"method": {"mu": [0.1, 0.3]}}
    runs = [{"config": load_config(None, VEC + x).model_dump(mode="json")} for x in (
        ["method=fedprox", "method.mu=0.1"], ["method=fedprox", "method.mu=0.3", "seed=2", "lr=0.1"],
        ["method=fedprox", "model.hidden=[32]"], ["method=fedavg"], ["method=fedprox", "method.mu=0.2"])]
    assert [[runs.index(r) for r in unit] for unit in packs(runs, 8)] == [[0, 1, 4], [2], [3]]
    assert [[runs.index(r) for r in unit] for unit in packs(runs, 2)] == [[0, 1], [2], [3], [4]]
    assert all(len(u) == 1 for u in packs(runs, "off"))
    assert all(len(u) == 1 for u in packs(runs, "auto"))  # on the CPU: whole runs side by side (--jobs) instead
    assert pack_key({**runs[0]["config"], "executor": "sequential"}) is None


def test_a_diverging_run_leaves_the_pack_and_the_others_go_on(tmp_path):
    extra = ["rounds=3"]
    pack, (good, bad) = packed(tmp_path, [extra, extra + ["lr=1e6", "seed=1"]])
    assert isinstance(bad, FloatingPointError)
    assert str(bad).startswith("round 1: client") and "(training diverged)" in str(bad)
    assert_as_alone(tmp_path, extra, "good", good, alone(tmp_path, extra, "good"))


class _Precomputed(Method):
    """A loss that reads its option through an attribute set at construction, not ``self.opt``:
    lanes cannot give each run its own value, so the pack must notice and stop merging."""

    name = "lanes_precomputed_test"

    class Options(Method.Options):
        scale: float = 1.0

    def __init__(self, options=None, info=None):
        super().__init__(options, info)
        self.scale = self.opt.scale

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
        return loss * self.scale, aux


def test_a_method_that_hides_an_option_trains_one_call_per_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(METHODS, _Precomputed.name, _Precomputed)
    configs = [[f"method={_Precomputed.name}", "method.scale=1.0"],
               [f"method={_Precomputed.name}", "method.scale=2.0", "seed=1"]]
    pack, results = packed(tmp_path, configs)
    assert not pack.merge and "differs from its run alone" in pack.reason
    assert "train one call per run from here" in capsys.readouterr().out
    for i, cfg in enumerate(configs):
        assert_as_alone(tmp_path, cfg, f"alone{i}", results[i], alone(tmp_path, cfg, f"alone{i}"))


def test_a_resumed_run_joins_a_pack_at_its_own_round(tmp_path):
    """Runs of a pack need not stand at the same round: one resumed at round 2 of 4 beside one
    starting at 0 (and a third with fewer rounds that ends first)."""
    from conftest import crash_after

    extra = ["rounds=4", "checkpoint_every=1"]
    cfg = load_config(None, vec(extra) + extra + ["seed=1"])
    with pytest.raises(KeyboardInterrupt):
        Experiment(cfg, tmp_path / "packed1").run(crash_after(1))
    pack = Pack()
    experiments = [Experiment(load_config(None, vec(extra) + extra), tmp_path / "packed0", pack=pack),
                   Experiment(cfg, tmp_path / "packed1", resume=True, pack=pack),
                   Experiment(load_config(None, VEC + ["rounds=2", "seed=2"]), tmp_path / "packed2", pack=pack)]
    results = pack.run(experiments)
    for i, e in enumerate((extra, extra + ["seed=1"], ["rounds=2", "seed=2"])):
        assert_as_alone(tmp_path, e, f"alone{i}", results[i], alone(tmp_path, e, f"alone{i}"))


def check_out_of_memory_halving(tmp_path, monkeypatch, capsys, extra=()):
    """A merged call that runs out of device memory is retried with half the lanes (faked: the first
    merged call of more than 5 lanes raises torch.OutOfMemoryError); the runs end as they do alone.
    Also tests/test_gpu.py's, on CUDA."""
    from fedskew.engine.lanes import LaneExecutor

    real, raised, failed_call, alive_at_retry = LaneExecutor.train_requests, [], [], []

    def tight(self, requests, check=False):
        if failed_call:  # the failed call's tensors must be freed before the retry (no traceback holds them)
            alive_at_retry.append(failed_call[0]() is not None)
        if sum(len(r.rows) for r in requests) > 5 and not raised:
            raised.append(1)
            stacked = torch.empty(1000)  # what the failed call had built; its frame holds it
            failed_call.append(weakref.ref(stacked))
            raise torch.OutOfMemoryError("CUDA out of memory (faked)")
        return real(self, requests, check)

    monkeypatch.setattr(LaneExecutor, "train_requests", tight)
    configs = [["rounds=2", *extra], ["rounds=2", "seed=1", *extra]]
    pack, results = packed(tmp_path, configs)
    assert raised and pack.max_lanes == 5 and pack.merge
    assert alive_at_retry and not any(alive_at_retry), "the retry ran while the failed call's tensors were held"
    assert "out of device memory with 10 lanes stacked" in capsys.readouterr().out
    for i, cfg in enumerate(configs):
        assert_as_alone(tmp_path, cfg, f"alone{i}", results[i], alone(tmp_path, cfg, f"alone{i}"))


def test_a_pack_out_of_memory_halves_its_lanes(tmp_path, monkeypatch, capsys):
    check_out_of_memory_halving(tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("entry", ["execute_run", "execute_pack"])
def test_a_worker_hands_its_cached_device_memory_back_once_its_runs_are_gone(tmp_path, monkeypatch, entry):
    """Workers share one GPU: after a run or a pack, ``torch.cuda.empty_cache`` runs once the runs'
    models are freed (a GPU window's idle workers held 33 GiB each, and the next pack ran out of
    memory at one lane). CUDA is faked as initialised; empty_cache records what was still alive."""
    from fedskew.experiments import pool

    models, alive_at_release, real_run = [], [], Experiment.run

    def run_and_watch(self, *args, **kwargs):
        models.append(weakref.ref(self.model))
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(Experiment, "run", run_and_watch)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: alive_at_release.append([m() is not None for m in models]))
    configs = [dict(load_config(None, vec([]) + ["rounds=1", f"seed={i}"]).model_dump(mode="json")) for i in (0, 1)]
    if entry == "execute_run":
        summary, _, _ = pool.execute_run(configs[0], str(tmp_path / "run"))
        assert "global/test_acc" in summary
    else:
        outcomes = pool.execute_pack(configs, [str(tmp_path / "a"), str(tmp_path / "b")])
        assert [o[0] for o in outcomes] == ["done", "done"]
    assert alive_at_release == [[False] * len(models)] and models


def test_each_worker_sizes_its_chunks_from_its_share_of_the_device(monkeypatch):
    """Workers that share one GPU each plan for 1 / jobs of its memory: in a GPU window four workers
    each sized their chunks from the whole card's free memory, and MAP's three runs ran out of
    memory however far they halved. CUDA's memory counters are faked (GiB: 100 total, 90 free, 6 reserved of which
    2 allocated)."""
    from fedskew.engine import memory
    from fedskew.experiments.pool import WorkerPool

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (90 * gib, 100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 6 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2 * gib)
    cuda = torch.device("cuda")
    monkeypatch.setattr(memory, "DEVICE_SHARE", 1.0)
    assert memory._device_memory(cuda) == 94 * gib  # free + the allocator's unused blocks
    monkeypatch.setattr(memory, "DEVICE_SHARE", 0.25)
    assert memory._device_memory(cuda) == 23 * gib  # a quarter of the card, less what this process holds
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 30 * gib)
    assert memory._device_memory(cuda) == 0  # over its share already: chunks of one client
    pool = WorkerPool(4, rec=None)  # the share each worker of a sweep's pool is given
    try:
        share = pool.pool.submit(eval, "__import__('fedskew.engine.memory').engine.memory.DEVICE_SHARE")
        assert share.result(timeout=120) == 0.25
    finally:
        pool.pool.shutdown()


# ---------------------------------------------------------------------------------------------
# Sweeps

SPEC = {"name": "lanes", "base": {"rounds": 4, "executor": "vectorized", "partition.num_clients": 8,
                                  "clients_per_round": 4, "local_epochs": 1, "model.hidden": [32],
                                  "final_personalization": False},
        "methods": ["fedavg", {"name": "fedprox", "options": {"mu": [0.01, 0.1]}}], "seeds": [0, 1]}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def cli(*args, cwd, timeout=300):
    return subprocess.run([sys.executable, "-m", "fedskew.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=ENV, timeout=timeout)


def summaries(folder):
    import fedskew

    return {
        r["run_id"]: (r["status"], r["global/test_acc_mean_last10"]) for r in fedskew.load_results(folder, frame=False)
    }


@pytest.mark.slow
def test_a_packed_sweep_equals_the_unpacked_one_and_bad_pack_values_are_one_sentence(tmp_path):
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(SPEC))
    for pack in ("4", "off"):
        done = cli("sweep", "s.yaml", "--out", f"sw-{pack}", "--jobs", "1", "--pack", pack, "--no-report", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    a, b = summaries(tmp_path / "sw-4"), summaries(tmp_path / "sw-off")
    assert a.keys() == b.keys() and {v[0] for v in a.values()} == {"done"}
    for k in a:
        assert a[k][1] == pytest.approx(b[k][1], abs=1e-6)
    for bad in ("0", "many", "-2"):
        done = cli("sweep", "s.yaml", "--out", "sw-bad", "--pack", bad, cwd=tmp_path)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert f"pack = '{bad}' is not allowed; give auto, off or a positive integer" in done.stderr
        assert not (tmp_path / "sw-bad").exists()


@pytest.mark.slow
def test_an_interrupted_packed_sweep_resumes_every_run_exactly(tmp_path):
    """SIGTERM to a packed sweep's worker pool once every run of the pack has a checkpoint; the same
    command then finishes it with the results of an uninterrupted packed sweep."""
    spec = {**SPEC, "base": {**SPEC["base"], "rounds": 40}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    cmd = [sys.executable, "-m", "fedskew.cli", "sweep", "s.yaml", "--jobs", "2", "--pack", "3", "--no-report"]
    proc = subprocess.Popen(cmd + ["--out", "cut"], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if len(list((tmp_path / "cut" / "runs").glob("*/checkpoint.pt"))) >= 4:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    import fedskew

    statuses = {r["status"] for r in fedskew.load_results(tmp_path / "cut", frame=False)}
    assert "interrupted" in statuses or "running" in statuses, statuses
    again = subprocess.run(cmd + ["--out", "cut"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    whole = subprocess.run(cmd + ["--out", "whole"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr
    for run_dir in (tmp_path / "whole" / "runs").iterdir():
        cut = tmp_path / "cut" / "runs" / run_dir.name
        assert [json.loads(line)["train/loss"] for line in (cut / "metrics.jsonl").read_text().splitlines()] == \
            [json.loads(line)["train/loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        ours = torch.load(cut / "checkpoint.pt", weights_only=True)["global_state"]
        ref = torch.load(run_dir / "checkpoint.pt", weights_only=True)["global_state"]
        assert all(torch.equal(ours[k], ref[k]) for k in ref)
