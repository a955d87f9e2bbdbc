"""The GPU window's mechanism on the CPU (issue 53): a window that stops mid-run, merged, then the
next window goes on from the merged results, to the tables an uninterrupted bench writes; and the
merge refuses what is not this code's or not the plan's, in one sentence, writing nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
sys.path.insert(0, str(ROOT / "benchmarks"))


def window(tmp_path, out, root, *extra, env=None):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_window.py"), "--out", str(out),
                           "--campaign-root", str(root), "--plan", "test", *map(str, extra)],
                          capture_output=True, text=True, env=env or ENV, cwd=tmp_path, timeout=1800)


def merge(files_at, root):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_merge.py"), str(files_at),
                           "--campaign-root", str(root)], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=600)


def tables(board: Path) -> list[str]:
    return [line for line in board.read_text().splitlines() if line.startswith("|")]


def test_a_window_without_cuda_is_one_sentence(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    done = window(tmp_path, tmp_path / "out", tmp_path / "root")
    assert done.returncode == 2 and "torch sees no CUDA device here, so no GPU job runs" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_window_stopped_mid_run_is_merged_and_the_next_one_finishes_to_the_uninterrupted_tables(tmp_path):
    from gpu_merge import head_commit

    env = {**ENV, "FEDSKEW_GIT_COMMIT": head_commit()}
    root = tmp_path / "campaign"
    kept = tmp_path / "kept"  # (the device commands' --keep-work: a second call on the machine goes on from it)
    first = window(tmp_path, tmp_path / "w1", root, "--allow-cpu", "--stop-after", "3", "--keep-work", kept, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    record = json.loads((tmp_path / "w1" / "window.json").read_text())
    assert record["campaign_step"] == "smoke-niid" and not record["campaign_complete"], record
    assert record["steps"][-1]["cut"]  # stopped by SIGINT while runs were left
    tests = [s for s in record["steps"] if s["name"] == "gpu-tests"]  # beside the campaign, in a thread
    assert tests and tests[0]["rc"] == 0 and "(exit 0" in (tmp_path / "w1" / "gpu-tests.txt").read_text()
    assert len(list((tmp_path / "w1").iterdir())) <= 8  # the device tool's limit on files back
    merged = merge(tmp_path / "w1", root)
    assert merged.returncode == 0, merged.stderr[-2000:]
    state = json.loads((root / "campaign.json").read_text())
    assert state["steps"]["smoke-niid"]["status"] == "partial" and len(state["windows"]) == 1
    assert not list(root.rglob("*.pt"))  # no weights in the campaign folder
    assert list(kept.rglob("checkpoint.pt"))  # the cut runs' checkpoints stay on the machine, for the next call
    second = window(tmp_path, tmp_path / "w2", root, "--allow-cpu", "--keep-work", kept, env=env)
    assert second.returncode == 0, second.stderr[-2000:]
    assert json.loads((tmp_path / "w2" / "window.json").read_text())["campaign_complete"]
    assert merge(tmp_path / "w2", root).returncode == 0
    assert json.loads((root / "campaign.json").read_text())["steps"]["smoke-niid"]["status"] == "complete"
    third = window(tmp_path, tmp_path / "w3", root, "--allow-cpu", env=env)  # nothing left: no campaign step
    assert json.loads((tmp_path / "w3" / "window.json").read_text())["campaign_step"] is None, third.stderr
    reference = subprocess.run([sys.executable, "-m", "fedskew.cli", "bench", "niid-bench", "--scale", "smoke",
                                "--seeds", "0", "--methods", "fedavg,fedprox", "--jobs", "1", "--out", "ref"],
                               capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1800)
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert tables(root / "smoke-niid" / "leaderboard.md") == tables(tmp_path / "ref" / "leaderboard.md")


def test_the_merge_refuses_another_commit_s_another_plan_s_or_a_lesser_campaign_folder(tmp_path):
    from gpu_merge import head_commit

    root, files = tmp_path / "campaign", tmp_path / "back"
    files.mkdir()
    (files / "window.json").write_text(json.dumps({"commit": "0123456789ab", "campaign_step": None}))
    done = merge(files, root)
    assert done.returncode == 2 and "the job ran commit '0123456789ab' and this checkout is" in done.stderr
    (files / "window.json").write_text(json.dumps({"commit": head_commit(), "campaign_step": "nope"}))
    done = merge(files, root)
    assert done.returncode == 2 and "campaign step 'nope', which is not in the plan" in done.stderr
    assert not root.exists()  # nothing written


def test_a_speed_step_measured_whole_is_left_out_of_later_windows_and_a_window_merges_once(tmp_path):
    """campaign.json's ``measured`` holds the speed steps a window brought back whole (exit 0, not
    cut); the next window's default steps leave them out, a cut one stays in. The window's commit
    may be the full hash (the device tool's command) or the short one. A window merged twice is
    refused, nothing written."""
    from gpu_merge import head_commit
    from gpu_window import STEPS, default_steps

    root, files = tmp_path / "campaign", tmp_path / "back"
    files.mkdir()
    full = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    commit = head_commit() if head_commit().endswith("+dirty") else full  # (a dirty tree has no full hash to give)
    steps = [{"name": "speed-engine", "rc": 0, "cut": False}, {"name": "speed-compile", "rc": 1, "cut": True},
             {"name": "gpu-tests", "rc": 0, "cut": False}]
    (files / "window.json").write_text(json.dumps({"commit": commit, "campaign_step": None, "card": "NVIDIA H200",
                                                   "started": "2026-11-28 19:16:53 UTC", "steps": steps}))
    (files / "speed.txt").write_text("mlp 100 clients: sequential 1.019s padded 0.035s\n")
    assert default_steps(root) == list(STEPS)
    done = merge(files, root)
    assert done.returncode == 0, done.stderr
    state = json.loads((root / "campaign.json").read_text())
    assert list(state["measured"]) == ["speed-engine"] and len(state["windows"]) == 1
    assert default_steps(root) == [s for s in STEPS if s != "speed-engine"]
    assert (tmp_path / "gpu-runs" / "2026-11-28-1916-NVIDIA-H200-window-speed.txt").is_file()
    before = (root / "campaign.json").read_text()
    again = merge(files, root)
    assert again.returncode == 2 and "is merged already; nothing is merged again" in again.stderr
    assert (root / "campaign.json").read_text() == before


def test_the_profile_s_figures_from_a_hand_made_trace():
    """benchmarks/gpu_profile.py's trace figures, against a trace whose answers are counted by hand:
    kernels [0, 10), [5, 15) and [20, 30) us over two rounds are 25 us busy (12.5 a round), one
    gap of 5 us; two launches; a 1 MiB host-to-device copy and a 4-byte one back; one synchronize."""
    from gpu_profile import merged, trace_summary

    assert merged([(20, 30), (0, 10), (5, 15), (15, 16)]) == [(0, 16), (20, 30)]
    k = {"ph": "X", "cat": "kernel"}
    trace = {"traceEvents": [
        {**k, "name": "sgemm_a", "ts": 0, "dur": 10}, {**k, "name": "sgemm_a", "ts": 5, "dur": 10},
        {**k, "name": "relu", "ts": 20, "dur": 10},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 4, "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 31, "dur": 1},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "ts": 17, "dur": 2,
         "args": {"bytes": 2**20}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)", "ts": 30, "dur": 1,
         "args": {"bytes": 4}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 3},
        {"ph": "i", "cat": "kernel", "name": "an instant, not a span", "ts": 3}]}
    s = trace_summary(trace, rounds=2)
    assert s["kernels"] == 1.5 and s["launches"] == 1 and s["syncs"] == 0.5 and s["ops"] == 0.5
    assert s["kernel_us"] == 12.5 and s["span_us"] == 30 and s["gaps"] == 0.5 and s["gap_us"] == 2.5
    assert s["longest_gap_us"] == 5 and s["gaps_over_100us"] == 0
    assert s["copies"] == {"Memcpy HtoD": (0.5, 2**19), "Memcpy DtoH": (0.5, 2.0)}
    assert s["top_kernels"] == [("sgemm_a", 10.0), ("relu", 5.0)]


def test_the_profile_runs_on_the_cpu_and_counts_a_round_s_flops(tmp_path, capsys):
    """The profile step of a GPU window, run on the CPU on a small Fashion-MNIST in its real format
    (every client in every round, so every round has the same steps): the FLOPs it counts for FedAvg
    on MLPNet lie between the training's weight products alone (forward 2 W and weight gradients
    2 W a sample and epoch, W = the layers' weights) and all of training's with every sample
    evaluated twice (6 W, and 2 x 2 W for the evaluations) over training and test samples."""
    import numpy as np

    from conftest import write_idx
    from gpu_profile import main

    rng = np.random.default_rng(0)
    (tmp_path / "fmnist").mkdir()
    for prefix, n in (("train", 400), ("t10k", 100)):
        write_idx(tmp_path / "fmnist" / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 255, (n, 28, 28)))
        write_idx(tmp_path / "fmnist" / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    assert main(["--device", "cpu", "--data", str(tmp_path), "--rounds", "1", "--profiled", "1", "--peak-tflops",
                 "1", "--config", "method=fedavg", "partition.num_clients=4", "clients_per_round=4",
                 "local_epochs=1"]) == 0
    out = capsys.readouterr().out
    assert "model mlpnet (1.99 M parameters), method fedavg" in out and "top host operators by self time" in out
    flops = float(out.split("FLOPs a round (torch.utils.flop_counter, matrix products, forward and backward): ")[1]
                  .split(" GFLOP")[0]) * 1e9
    weights = 784 * 1024 + 1024 * 1024 + 1024 * 128 + 128 * 10
    train = 400  # every training sample in the round, one epoch (the local test split comes out of it)
    assert 4 * weights * train * 0.75 <= flops <= (6 * weights * train + 4 * weights * (train + 100)), flops
    assert "fraction of the FP32 peak (1 TFLOP/s, given with --peak-tflops)" in out


def test_a_window_runs_the_campaign_step_with_the_tests_first_and_the_speed_steps_after(tmp_path, monkeypatch):
    """The order a window spends its budget in, on a stand-in card (no GPU here; every step's command
    recorded, none run): the CUDA tests start, the campaign step runs beside them with the budget
    less the speed steps' share (their limits, at most half the budget), and only then the speed
    steps, each alone, in SPEED's order, each within its own limit and the time left."""
    import threading

    import torch

    import gpu_window

    clock = [0.0]
    calls = []

    def run_step(cmd, limit, log, env, cwd, stop=None):
        name = "tests" if "pytest" in cmd else "campaign" if "bench" in cmd else Path(cmd[1]).stem
        calls.append((name, round(clock[0]), round(limit), threading.current_thread() is threading.main_thread()))
        # (the tests run beside the campaign: no wall time of their own; the campaign takes its whole limit)
        clock[0] += {"tests": 0, "campaign": limit}.get(name, min(limit, 60))
        return {"cmd": cmd, "rc": 0, "seconds": 1.0, "cut": name == "campaign"}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in card")
    monkeypatch.setattr(gpu_window, "run_step", run_step)
    monkeypatch.setattr(gpu_window.time, "monotonic", lambda: clock[0])
    steps = ["gpu-tests", "speed-compile", "speed-fedmr-round", "speed-profile", "campaign"]
    assert gpu_window.window(tmp_path / "out", None, 540, gpu_window.TEST_PLAN, tmp_path / "root", False,
                             steps=steps) == 0
    speed = {k: v[1] for k, v in gpu_window.SPEED.items() if k in steps}
    share = min(sum(speed.values()), 540 / 2)
    # (the tests' thread and the campaign start together: either may record its call first)
    assert sorted(c[0] for c in calls[:2]) == ["campaign", "tests"]
    assert [c[0] for c in calls[2:]] == ["compile_speed", "engine_speed", "gpu_profile"]
    campaign, tests = sorted(calls[:2])
    assert tests[3] is False and campaign[3] is True  # the tests in their thread, beside the campaign
    assert campaign[2] == 540 - share - 60  # the campaign's limit: the budget less the speed share and a minute
    clock_at, limits = [c[1] for c in calls[2:]], [c[2] for c in calls[2:]]
    assert clock_at[0] >= campaign[1] + campaign[2]  # the speed steps after the campaign ended
    assert all(limit <= speed[name] for limit, name in zip(limits, speed))
    assert all(at + limit <= 540 for at, limit in zip(clock_at, limits))  # none runs past the budget
    record = json.loads((tmp_path / "out" / "window.json").read_text())
    assert [s["name"] for s in record["steps"]] == ["gpu-tests", "campaign smoke-niid", *speed]


def test_the_campaign_s_paper_scale_boards_joined_are_set_beside_the_lite_board(tmp_path):
    """When a step is merged, the suite's steps' boards (map-part and map-rest each ran some of MAP's
    methods) are joined and set beside the committed lite board: Kendall's tau-b per table."""
    from gpu_merge import main, rank_report
    from test_bench import _written_board

    seeds = lambda v: {0: v, 1: v + 0.01, 2: v - 0.01}  # noqa: E731
    root, boards = tmp_path / "campaign", tmp_path / "leaderboards"
    for step, methods in (("map-part", {"a": 0.9, "b": 0.8}), ("map-rest", {"c": 0.6, "d": 0.7, "e": 0.5})):
        (root / step).mkdir(parents=True)
        (root / step / "leaderboard.md").write_text(_written_board({(m, "s"): seeds(v) for m, v in methods.items()}))
    (root / "campaign.json").write_text(json.dumps({"steps": {"map-part": {"status": "complete"}}, "windows": []}))
    assert rank_report(root, "seed-papers", boards) is None  # no lite board to compare with
    boards.mkdir()
    (boards / "seed-papers-lite.md").write_text(_written_board({(m, "s"): seeds(v) for m, v in
                                                                zip("abcde", (0.9, 0.8, 0.7, 0.6, 0.5))}))
    report = rank_report(root, "seed-papers", boards).read_text()
    assert "[map-part](map-part/leaderboard.md) (complete), [map-rest](map-rest/leaderboard.md) (not merged)" in report
    # c and d swapped of 5: tau 0.8, exact two-sided p 10 / 120
    assert ("- map: global accuracy (test set, mean of the last 10 rounds), s: Kendall's tau-b 0.80, p = 0.083 over "
            "the 5 methods both rank; moved most (rank among them): c (#4 at paper scale, #3 on the lite board); "
            "d (#3 at paper scale, #4 on the lite board).") in report
    assert rank_report(root, "niid-bench", boards) is None  # no step of that suite has a board
    assert main(["--ranks", "niid-bench", "--campaign-root", str(root)]) == 0
    # two steps that both rank a method: one sentence, no traceback, nothing written
    (root / "map-rest" / "leaderboard.md").write_text((root / "map-part" / "leaderboard.md").read_text())
    (root / "seed-papers-paper-vs-lite.md").unlink()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_merge.py"), "--ranks", "seed-papers",
                           "--campaign-root", str(root)], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 2 and "has a mean in 'map: global accuracy" in done.stderr
    assert "Traceback" not in done.stderr and not (root / "seed-papers-paper-vs-lite.md").exists()


def test_the_campaign_s_map_steps_run_every_method_with_a_published_map_cell():
    """map-part and map-rest together: each method that MAP's Tables I and II give a number at paper
    scale, once (pFedMe and FLDA were left out of the plan once)."""
    import gpu_window
    from fedskew.experiments.bench import linked_entries

    ran = [m for s in gpu_window.CAMPAIGN if s["step"].startswith("map-")
           for m in s["bench"][s["bench"].index("--methods") + 1].split(",")]
    published = {e.run_label for e in linked_entries("seed-papers", "paper") if e.file.startswith("map_")}
    assert len(ran) == len(set(ran)) and set(ran) == published, (sorted(ran), sorted(published))
