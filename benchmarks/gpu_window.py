"""One time-limited GPU job of a long campaign: what fits in ``--budget`` seconds, the rest left for the next.

docs/gpu-campaign/README.md says how a campaign runs in such jobs. A job is sized to finish inside
its budget (default 540 s, for a machine held 15 minutes whose commands run at most 10), each step
under its own time limit:

1. side by side: CUDA correctness, ``python -m pytest -m gpu`` (tests/test_gpu.py) in a thread ->
   ``gpu-tests.txt``; and the next step of the campaign (:data:`CAMPAIGN`, by cost) that the
   repository's campaign folder does not hold complete, with the time the speed steps leave:
   ``fedskew bench ...`` in a folder seeded from the campaign folder (its finished runs are
   skipped), stopped by SIGINT at its limit (every run checkpoints and is marked interrupted) ->
   ``campaign.tar.gz`` (the bench folder's results database and each run's text files; no data or
   weights) and ``campaign.txt`` (its log);
2. then the speed figures (:data:`SPEED`), each step alone on the card, ratios measured in the same
   call: the engine table at 10 and 100 clients, runs as lanes, the compiled step against the eager
   one (benchmarks/compile_speed.py: ``compile``'s CUDA default waits on it), one FedMR ResNet-18
   round, and where a paper-scale MAP round's time goes (benchmarks/gpu_profile.py) -> ``speed.txt``.
   A step an earlier job brought back whole is left out (:func:`default_steps`).

It writes ``window.json`` (card, torch, commit, each step's exit status and seconds) beside them:
at most 6 files. ``benchmarks/gpu_merge.py FILES_AT``, run at home after the job, checks them and
merges them into ``docs/gpu-campaign/``, so the next job, on any machine, goes on where this one
stopped. Runs cut at the limit restart in the next job (their checkpoints are weights: not in the
repository).

At home, before (a bare GPU machine's Python 3.12 may lack pydantic; the data must travel)::

    python benchmarks/gpu_window.py --prepare --data DATA_DIR   # .whl/ and .gpu-data/ (ignored), then the commands

On the GPU machine, with ``.whl/`` and ``.gpu-data/`` beside the code: the printed command, then,
on the same machine, the second one (``--steps campaign``) with the time left.
Without a CUDA device it refuses in one sentence (``--allow-cpu`` runs the mechanism on the CPU: the
tests of tests/test_gpu_window.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # fedskew from this checkout (the device machine has it nowhere else)
CAMPAIGN_ROOT = ROOT / "docs" / "gpu-campaign"
WHEELS = ["pydantic==2.13.4", "pydantic-core==2.46.4", "annotated-types==0.7.0", "typing-inspection==0.4.2"]

# The campaign, by cost (issue 53, item 3): each step is one `fedskew bench` call, resumable across
# windows. Its name is the folder under docs/gpu-campaign/.
CAMPAIGN = [
    {"step": "map-part", "about": "MAP Tables I and II (FaMnist MLPNet): FedAvg, FedRS, FedPHP, MAP, seeds 0-2",
     "bench": ["seed-papers", "--scale", "paper", "--parts", "map", "--seeds", "0,1,2",
               "--methods", "fedavg,fedrs,fedphp,map", "--checkpoint-every", "50"]},
    {"step": "map-rest", "about": "MAP Tables I and II: the other methods with a published cell, seeds 0-2",
     "bench": ["seed-papers", "--scale", "paper", "--parts", "map", "--seeds", "0,1,2", "--methods",
               "fedprox,scaffold,perfedavg,pfedme,fedrod,ditto,dittors,fedmmd,fedaws,moon,fednova,feddyn,flda,"
               "fedrep,fedproto", "--checkpoint-every", "50"]},
    {"step": "niid-fmnist", "about": "NIID-Bench's FMNIST protocol, 4 methods x 5 partitions, seeds 0-2",
     "bench": ["niid-bench", "--scale", "paper", "--parts", "niid-fmnist", "--seeds", "0,1,2"]},
    {"step": "label-skew-first", "about": "the label-skew suite at paper scale: FedAvg, FedRS, FedLC, FedDecorr",
     "bench": ["label-skew", "--scale", "paper", "--methods", "fedavg,fedrs,fedlc,feddecorr"]},
]
# a plan for the tests on the CPU: the same mechanism on the bundled digits
TEST_PLAN = [{"step": "smoke-niid", "about": "niid-bench at smoke scale (digits)",
              "bench": ["niid-bench", "--scale", "smoke", "--seeds", "0", "--methods", "fedavg,fedprox"]}]
KEEP = (".sqlite", ".yaml", ".json", ".jsonl", ".md", ".html")  # what a campaign folder holds: text and SQLite


class CampaignRecord(BaseModel):
    """campaign.json: each step's status, each merged job, the speed steps measured."""

    model_config = ConfigDict(extra="forbid")
    steps: dict[str, dict[str, Any]] = {}
    windows: list[dict[str, Any]] = []
    measured: dict[str, dict[str, Any]] = {}


def campaign_state(root: Path) -> dict:
    """campaign.json through fedskew's file boundary (a regular file, a few MB, valid JSON, the
    record's shape), or a new record where there is none; a damaged one is one sentence."""
    from fedskew.files import read_json

    path = root / "campaign.json"
    if not os.path.lexists(path):
        return {"steps": {}, "windows": []}
    state = read_json(path, "campaign record", model=CampaignRecord).model_dump(exclude_unset=True)
    return {"steps": {}, "windows": [], **state}


def next_step(plan: list[dict], root: Path) -> dict | None:
    done = campaign_state(root)["steps"]
    return next((s for s in plan if done.get(s["step"], {}).get("status") != "complete"), None)


def done_runs(db_path: Path) -> set[str]:
    """The ids of a results database's finished runs (none while it is absent or being created)."""
    import sqlite3

    if not db_path.is_file():
        return set()
    con = sqlite3.connect(db_path)
    try:
        return {r[0] for r in con.execute("SELECT run_id FROM runs WHERE status='done'")}
    except sqlite3.Error:
        return set()
    finally:
        con.close()


def done_in(folder: Path) -> set[str]:
    """The finished runs of a bench folder's results databases."""
    return {r for db in folder.glob("*/results.sqlite") for r in done_runs(db)}


def finished(folder: Path) -> int:
    """How many runs a bench folder holds finished."""
    return len(done_in(folder))


def run_step(cmd: list[str], limit: float, log: Path, env: dict, cwd: Path, stop=None) -> dict:
    """``cmd`` under ``limit`` seconds, its output in ``log``; at the limit (or once ``stop()`` says
    so) SIGINT (a bench stops after the round it is in, checkpointing), then SIGKILL 90 s later. Its
    exit status and time."""
    t0 = time.monotonic()
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)} (limit {limit:.0f} s)\n")
        out.flush()
        if limit < 5:
            out.write("skipped: no time left\n")
            return {"cmd": cmd, "rc": None, "seconds": 0.0, "cut": True}
        from fedskew.engine.reaper import Reaper

        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        reaper = Reaper()  # the step's whole group dies with this script, however it dies
        reaper.watch(proc.pid, group=True)
        cut = False
        try:
            while stop is not None and proc.poll() is None and time.monotonic() - t0 < limit and not stop():
                time.sleep(0.5)
            if stop is not None and proc.poll() is None and stop():
                raise subprocess.TimeoutExpired(cmd, limit)
            proc.wait(timeout=max(0.0, limit - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            cut = True
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reaper.close(kill=True)  # (workers the step left behind)
        seconds = time.monotonic() - t0
        out.write(f"(exit {proc.returncode}, {seconds:.0f} s{', cut at its limit' if cut else ''})\n")
    return {"cmd": cmd, "rc": proc.returncode, "seconds": round(seconds, 1), "cut": cut}


def pack(folder: Path, target: Path) -> int:
    """The bench folder's results database and runs' text files as one tar.gz; its size in bytes."""
    with tarfile.open(target, "w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and path.suffix in KEEP:
                tar.add(path, arcname=str(path.relative_to(folder)))
    return target.stat().st_size


def seed(work: Path, root: Path, step: str) -> None:
    """The work folder starts as the campaign folder of the step (its finished runs are skipped)."""
    if (root / step).is_dir():
        shutil.copytree(root / step, work, dirs_exist_ok=True)


def work_folder(keep: Path | None, root: Path, step: str) -> Path:
    """The campaign step's bench folder on this machine. Without ``keep``: a new folder seeded from
    the campaign folder, removed once packed. With ``keep`` (the printed commands pass it): the
    folder an earlier call on this machine left there, when it holds every run the campaign folder
    holds finished, so that a second job on the machine goes on from the first's finished runs and
    resumes its cut ones from their checkpoints; else a new one seeded from the campaign folder."""
    if keep is None:
        work = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-window-{os.getpid()}" / step
        seed(work, root, step)
        return work
    work = keep / step
    if not work.is_dir() or not done_in(root / step) <= done_in(work):
        shutil.rmtree(work, ignore_errors=True)
        seed(work, root, step)
    return work


# The speed steps: (arguments after the interpreter, seconds at most). Each runs alone (nothing else
# on the card) and, once a job has brought it back whole, is left out of later jobs
# (campaign.json's "measured"; --steps names it to measure it again).
SPEED = {
    "speed-engine": (["benchmarks/engine_speed.py", "--device", "cuda", "--precision", "fp32", "--clients", "10", "100",
                      "--models", "mlp", "tcnn", "cnnbn", "--engines", "sequential", "grouped", "padded",
                      "--rounds", "3"], 80),
    "speed-lanes": (["benchmarks/lanes_speed.py", "--device", "cuda", "--runs", "20", "--rounds", "5",
                     "--repeats", "1"], 40),
    # compile=on against the eager step: its CUDA default waits on this number (51 s was too short for
    # its first compilation).
    "speed-compile": (["benchmarks/compile_speed.py", "--device", "cuda", "--rounds", "5"], 180),
    # FedMR Table 1's cost on this card (ResNet-18, a tenth of each client's data, projected; the
    # 58 s cut a quarter's two rounds), and channels_last's gain on it (whose auto
    # waits on this number): the plan leaves FedMR out while a run costs GPU-hours
    "speed-fedmr-round": (["benchmarks/engine_speed.py", "--device", "cuda", "--paper", "fedmr", "--paper-fraction",
                           "0.1", "--engines", "bare", "sequential", "sequential-cl", "padded", "--rounds", "1"], 150),
    # where a paper-scale MAP round's time goes on the card (item 3): kernels against the host, launches a
    # step, copies, syncs, idle gaps, and the round's FLOPs against the card's FP32 peak
    "speed-profile": (["benchmarks/gpu_profile.py", "--device", "cuda", "--rounds", "3", "--profiled", "2"], 150),
}
STEPS = ("gpu-tests", *SPEED, "campaign")
WRITES_JSON = ("speed-engine", "speed-lanes")  # the speed steps whose script writes a --json record


def default_steps(root: Path) -> list[str]:
    """Every step but the speed steps an earlier job measured whole."""
    measured = campaign_state(root).get("measured", {})
    return [s for s in STEPS if s not in measured]


def window(out: Path, data: str | None, budget: float, plan: list[dict], root: Path, allow_cpu: bool,
           campaign_limit: float | None = None, stop_after: int | None = None, steps=STEPS,
           keep: Path | None = None) -> int:
    """In the order the campaign needs them: the CUDA tests in a thread beside the next campaign step
    (the tests use a sliver of the card: alone they took 157 s on an H200, and 9 of a step's 12
    campaign runs finished only in a second call), with the time left once the speed steps' limits
    are set aside; then the speed steps, each alone on the card."""
    import threading

    import torch

    start = time.monotonic()
    if not torch.cuda.is_available() and not allow_cpu:
        print("gpu_window: torch sees no CUDA device here, so no GPU job runs (run it on a machine with a GPU; "
              "--allow-cpu runs the mechanism on the CPU for its tests).", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    record = {"commit": os.environ.get("FEDSKEW_GIT_COMMIT"), "card": torch.cuda.get_device_name(0)
              if device == "cuda" else "cpu (no CUDA: a test of the mechanism)", "torch": torch.__version__,
              "device": device, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "steps": []}
    speed = {name: value for name, value in SPEED.items() if name in steps} if device == "cuda" else {}
    # the speed steps' time, set aside for after the campaign step: their limits, at most half the budget
    # (the campaign step comes first; a speed step cut or not reached is measured by the next job)
    reserve = min(sum(limit for _, limit in speed.values()), budget / 2)
    left = lambda: budget - (time.monotonic() - start) - reserve  # noqa: E731  (the campaign's and tests' time)
    py = sys.executable
    tests, tests_done = {}, None
    if "gpu-tests" in steps:  # (on the CPU, with --allow-cpu, its tests skip: the mechanism's test)
        # 4 test processes (the host has 16 cores): the registry-wide case adds 148 small runs to the
        # 17 checks that took 157 s in one process on an H200
        cmd = [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-n", "4" if device == "cuda" else "0",
               "tests/test_gpu.py"]
        tests_done = threading.Thread(target=lambda: tests.update(run_step(cmd, left() - 45, out / "gpu-tests.txt",
                                                                          env, ROOT)))
        tests_done.start()
    step = next_step(plan, root) if "campaign" in steps else None
    record["campaign_step"] = step["step"] if step else None
    campaign = None
    if step is not None:
        work = work_folder(keep, root, step["step"])
        cmd = [py, "-m", "fedskew.cli", "bench", *step["bench"], "--out", str(work), "--jobs", "4" if device == "cuda"
               else "1"] + (["--data", data] if data else []) + (["--device", "cuda", "--executor", "vectorized",
                                                                  "--pack", "auto"] if device == "cuda" else [])
        limit = campaign_limit if campaign_limit is not None else left() - 60  # a minute to stop and pack
        before = finished(work)
        stop = (lambda: finished(work) >= before + stop_after) if stop_after else None
        result = run_step(cmd, limit, out / "campaign.txt", env, ROOT, stop)
        campaign = {"name": f"campaign {step['step']}", **result}
        record["campaign_complete"] = result["rc"] == 0 and not result["cut"]
        if work.is_dir():
            record["campaign_bytes"] = pack(work, out / "campaign.tar.gz")
        if keep is None:
            shutil.rmtree(work.parent, ignore_errors=True)  # packed: the checkpoints there do not come back
    if tests_done is not None:
        tests_done.join()
        record["steps"].append({"name": "gpu-tests", **tests})
    if campaign is not None:
        record["steps"].append(campaign)
    for name, (args, limit) in speed.items():  # alone on the card now, in the order of SPEED
        reads_data = name in ("speed-compile", "speed-fedmr-round", "speed-profile")
        extra = ["--data", data] if data and reads_data else []
        time_left = budget - (time.monotonic() - start) - 15
        result_file = out / f"{name}.json"  # (engine and lanes write their figures for docs/performance.md)
        writes = ["--json", str(result_file)] if name in WRITES_JSON else []
        record["steps"].append({"name": name, **run_step([py, *args, *extra, *writes], min(limit, time_left),
                                                         out / "speed.txt", env, ROOT)})
        if result_file.is_file():  # folded into window.json: what comes back stays a few files
            record.setdefault("results", {})[name] = json.loads(result_file.read_text())
            result_file.unlink()
    record["seconds"] = round(time.monotonic() - start, 1)
    (out / "window.json").write_text(json.dumps(record, indent=2))
    print(json.dumps({k: record[k] for k in ("card", "campaign_step", "seconds")}))
    return 0


def prepare(data: str | None = None) -> int:
    """At home, before the job: the wheels a bare GPU machine's Python 3.12 lacks, Fashion-MNIST from
    ``data`` beside the code (both ignored by git, to be copied with it), then the commands to run there."""
    from fedskew.engine.rundir import git_commit

    commit = git_commit()
    if not commit or commit.endswith("+dirty"):
        print(f"gpu_window: the checkout is {commit or 'not a git commit'}; commit first, so that the job's runs "
              "are one commit's and its files merge.", file=sys.stderr)
        return 2
    # a copy of the working tree carries untracked files too, so a job could run code no commit holds
    untracked = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=all"],
                               capture_output=True, text=True).stdout.splitlines()
    if untracked:
        print(f"gpu_window: the checkout holds {len(untracked)} file(s) git does not track and does not ignore "
              f"(first: {untracked[0][3:]}); a copy of the tree would carry them, so commit, remove or ignore them "
              f"first.", file=sys.stderr)
        return 2
    exclude = ROOT / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    exclude.write_text("\n".join(lines + [x for x in ("/.whl/", "/.gpu-data/") if x not in lines]) + "\n")
    platforms = [a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
                 for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(ROOT / ".whl"),
                    *WHEELS], check=True)
    source = Path(data or os.environ.get("FEDSKEW_DATA", "data")) / "fashion-mnist"
    if not any(source.glob("*.gz")):
        print(f"gpu_window: no Fashion-MNIST files in '{source}'; give --data DATA_DIR (the folder holding "
              f"fashion-mnist/).", file=sys.stderr)
        return 2
    (ROOT / ".gpu-data" / "fashion-mnist").mkdir(parents=True, exist_ok=True)
    for f in source.glob("*.gz"):
        shutil.copy(f, ROOT / ".gpu-data" / "fashion-mnist" / f.name)
    setup = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
             f".whl/*.whl && export PYTHONPATH=/tmp/site || exit; FEDSKEW_GIT_COMMIT={commit} python3 "
             "benchmarks/gpu_window.py --out $OUT --data .gpu-data --keep-work /tmp/fedskew-window")
    print("on the GPU machine, with .whl/ and .gpu-data/ beside the code, a command limit of 600 s:\n" + setup +
          "\n\nthen, on the same machine, with the time left (the campaign goes on; merge each command's files, "
          "the first's first), a limit of 260 s:\n" + setup + " --steps campaign --budget 230")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prepare", action="store_true", help="at home: wheels and data for the GPU machine, then the "
                                                          "commands")
    p.add_argument("--out", type=Path, help="where the job writes what comes back")
    p.add_argument("--data", help="the data folder (Fashion-MNIST's IDX files)")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for the whole job (default 540: 9 min of "
                                                               "a 10-minute command limit)")
    p.add_argument("--campaign-root", type=Path, default=CAMPAIGN_ROOT)
    p.add_argument("--plan", choices=["campaign", "test"], default="campaign")
    p.add_argument("--allow-cpu", action="store_true", help="run the mechanism without CUDA (tests)")
    p.add_argument("--campaign-limit", type=float, help="seconds for the campaign step (default: what is left)")
    p.add_argument("--stop-after", type=int, help="stop the campaign step after this many more finished runs "
                                                  "(sizing a step; the tests' job that stops mid-run)")
    p.add_argument("--keep-work", type=Path, help="keep the campaign's bench folder under this folder, and go on "
                                                  "from it in a later call on this machine (the printed commands)")
    p.add_argument("--steps", help=f"the steps to run, comma-separated, of {','.join(STEPS)} (default: all but the "
                                   "speed steps an earlier job measured whole)")
    args = p.parse_args(argv)
    steps = args.steps.split(",") if args.steps else default_steps(args.campaign_root)
    if unknown := [s for s in steps if s not in STEPS]:
        p.error(f"--steps: {','.join(unknown)} is not a step; the steps are {','.join(STEPS)}")
    if args.prepare:
        return prepare(args.data)
    if args.out is None:
        p.error("--out is required (the folder whose files come back)")
    return window(args.out, args.data, args.budget, TEST_PLAN if args.plan == "test" else CAMPAIGN,
                  args.campaign_root, args.allow_cpu, args.campaign_limit, args.stop_after, steps,
                  args.keep_work.resolve() if args.keep_work else None)  # (the bench runs in the repository)


if __name__ == "__main__":
    sys.exit(main())
