"""Merge what a GPU window brought back into the repository (issue 53; the window:
benchmarks/gpu_window.py).

    python benchmarks/gpu_merge.py FILES_AT [--campaign-root docs/gpu-campaign]

FILES_AT holds ``window.json`` and, when the window reached its campaign step, ``campaign.tar.gz``;
``gpu-tests.txt``, ``speed.txt`` and ``campaign.txt`` are copied to ``docs/gpu-runs/`` under the
window's date, minute and card.
The campaign step's bench folder (results database, each run's config, summary, metrics and
identity; no data or weights) replaces ``CAMPAIGN_ROOT/<step>/`` when it holds every finished run
that folder held, ``campaign.json`` records the step (complete or partial) and the window, and the
step's leaderboard is rebuilt from the merged runs. Refused in one sentence, nothing written: files
of a window run at another commit than this checkout's (its runs are not this code's), a campaign
step that is not in the plan, a bench folder of another suite than the step's, or one that lacks
finished runs the campaign folder holds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_window import CAMPAIGN, CAMPAIGN_ROOT, KEEP, ROOT, SPEED, TEST_PLAN, campaign_state, done_runs, finished  # noqa: E402


class Refused(Exception):
    """One sentence: why nothing was merged."""


def head_commit() -> str:
    from fedskew.engine.rundir import git_commit

    return git_commit() or "no git commit"


def merge(files_at: Path, root: Path, commit: str | None = None) -> str:
    record_path = files_at / "window.json"
    if not record_path.is_file():
        raise Refused(f"'{files_at}' holds no window.json: it is not what benchmarks/gpu_window.py writes.")
    record = json.loads(record_path.read_text())
    commit = commit or head_commit()
    ran = record.get("commit") or ""
    if not (len(ran) >= 7 and (ran.startswith(commit) or commit.startswith(ran))):  # (full or short hashes)
        raise Refused(f"the window ran commit {record.get('commit')!r} and this checkout is {commit!r}: its runs are "
                      f"not this code's, so nothing is merged (check out that commit, or run a new window).")
    plan = {s["step"]: s for s in CAMPAIGN + TEST_PLAN}
    step = record.get("campaign_step")
    summary = [f"window on {record.get('card')} ({record.get('seconds')} s)"]
    started = record.get("started", "")  # (two windows of one day and card: the minute tells them apart)
    card = "".join(c if c.isalnum() else "-" for c in record.get("card", ""))[:40]
    stamp = f"{started[:10]}-{started[11:16].replace(':', '')}-{card}"
    tarball = files_at / "campaign.tar.gz"
    if step is not None and step not in plan:
        raise Refused(f"the window ran campaign step {step!r}, which is not in the plan "
                      f"({', '.join(plan)}); nothing is merged.")
    state = campaign_state(root)
    if any(w.get("started") == started and w.get("commit") == record.get("commit") for w in state["windows"]):
        raise Refused(f"the window of {started} ({record.get('commit')}) is merged already; nothing is merged again.")
    state["windows"].append({k: record.get(k) for k in ("started", "card", "commit", "seconds", "campaign_step")})
    for s in record.get("steps", []):  # a speed step brought back whole is left out of later windows
        if s["name"] in SPEED and s.get("rc") == 0 and not s.get("cut"):
            state.setdefault("measured", {})[s["name"]] = {k: record.get(k) for k in ("started", "card", "commit")}
    if step is not None and tarball.is_file():
        suite = plan[step]["bench"][0]
        scale = plan[step]["bench"][plan[step]["bench"].index("--scale") + 1]
        with tempfile.TemporaryDirectory() as tmp:
            with tarfile.open(tarball) as tar:
                members = [m for m in tar.getmembers() if m.isfile() and Path(m.name).suffix in KEEP
                           and not Path(m.name).is_absolute() and ".." not in Path(m.name).parts]
                tar.extractall(tmp, members=members)
            import yaml

            from fedskew.experiments.bench import MARKER

            got = Path(tmp)
            claimed = yaml.safe_load((got / MARKER).read_text()) if (got / MARKER).is_file() else {}
            if (claimed or {}).get("suite") != suite or (claimed or {}).get("scale") != scale:
                raise Refused(f"campaign.tar.gz holds a bench folder of another suite or scale than step {step!r} "
                              f"({suite}, {scale}); nothing is merged.")
            target = root / step
            for db in target.glob("*/results.sqlite"):
                lost = done_runs(db) - done_runs(got / db.parent.name / "results.sqlite")
                if lost:
                    raise Refused(f"campaign.tar.gz lacks {len(lost)} finished runs that {db} holds; nothing is "
                                  f"merged (was the window seeded from another campaign folder?).")
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(got, target)
        status = "complete" if record.get("campaign_complete") else "partial"
        state["steps"][step] = {"status": status, "about": plan[step]["about"]}
        done = finished(target)
        summary.append(f"campaign step {step}: {status}, {done} finished runs in {target}")
        rebuilt = subprocess.run([sys.executable, "-m", "fedskew.cli", "bench", suite, "--scale", scale, "--out",
                                  str(target), "--report"], capture_output=True, text=True, cwd=ROOT)
        summary.append(f"leaderboard: {target / 'leaderboard.md'}" if rebuilt.returncode == 0 else
                       f"leaderboard not rebuilt: {rebuilt.stderr.strip()[-300:]}")
    root.mkdir(parents=True, exist_ok=True)
    (root / "campaign.json").write_text(json.dumps(state, indent=2) + "\n")
    runs_dir = root.parent / "gpu-runs"
    for name in ("gpu-tests.txt", "speed.txt", "campaign.txt"):
        if (files_at / name).is_file():
            runs_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(files_at / name, runs_dir / f"{stamp}-window-{name}")
            summary.append(f"{name} -> {runs_dir / f'{stamp}-window-{name}'}")
    return "; ".join(summary)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files_at", type=Path, help="the folder the window's files came back to")
    p.add_argument("--campaign-root", type=Path, default=CAMPAIGN_ROOT)
    args = p.parse_args(argv)
    try:
        print(merge(args.files_at, args.campaign_root))
    except Refused as exc:
        print(f"gpu_merge: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
