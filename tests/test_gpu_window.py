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
    assert done.returncode == 2 and "torch sees no CUDA device here, so no window runs" in done.stderr
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
    assert done.returncode == 2 and "the window ran commit '0123456789ab' and this checkout is" in done.stderr
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
