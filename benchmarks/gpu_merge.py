"""Merge what a time-limited GPU job brought back into the repository (the job: benchmarks/gpu_window.py).

    python benchmarks/gpu_merge.py FILES_AT [--campaign-root docs/gpu-campaign]
    python benchmarks/gpu_merge.py --ranks seed-papers     # the campaign against the lite board again

FILES_AT holds ``window.json`` and, when the job reached its campaign step, ``campaign.tar.gz``;
``gpu-tests.txt``, ``speed.txt`` and ``campaign.txt`` are copied to ``docs/gpu-runs/`` under the
job's date, minute and card.
The campaign step's bench folder (results database, each run's config, summary, metrics and
identity; no data or weights) replaces ``CAMPAIGN_ROOT/<step>/`` when it holds every finished run
that folder held, ``campaign.json`` records the step (complete only with its runs there, else
partial) and the job, and the step's leaderboard is rebuilt from the merged runs. Then the
suite's paper-scale boards (its steps' leaderboards, joined) are set beside its committed lite
board: ``CAMPAIGN_ROOT/<suite>-paper-vs-lite.md``, Kendall's tau-b per ranked table and setting.

What came back is untrusted input: ``window.json`` is parsed into a schema; the archive is
extracted with the standard library's ``data`` filter, regular files only, under a size budget per
member and in total, modes 0644; the copied logs must be regular files (not links) within the same
budget; every check runs before anything is written, and ``campaign.json`` is written once,
atomically. Refused in one sentence, nothing written: files of a job run at another commit than
this checkout's, a campaign step that is not in the plan, a bench folder of another suite than the
step's, one that lacks finished runs the campaign folder holds, and anything malformed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedskew.config import ConfigError
from fedskew.engine.durable import replace_folder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_window import CAMPAIGN, CAMPAIGN_ROOT, KEEP, ROOT, SPEED, TEST_PLAN, campaign_state, done_runs, finished  # noqa: E402

MEMBER_BYTES = 256 * 2**20  # a results database of a paper-scale step is a few MiB; a log, less
TOTAL_BYTES = 1024 * 2**20
LITE_BOARDS = ROOT / "docs" / "leaderboards"  # the committed lite boards a campaign step is set beside
LOGS = ("gpu-tests.txt", "speed.txt", "campaign.txt")


class Refused(Exception):
    """One sentence: why nothing was merged."""


class Step(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    rc: int | None = None
    cut: bool = False


class Result(BaseModel):
    """A benchmark's record (benchmarks/common.py's write_result), as a job brought it back."""

    model_config = ConfigDict(extra="forbid")
    benchmark: str = Field(pattern=r"^[a-z][a-z0-9-]{0,40}$")
    title: str = Field(max_length=200)
    command: str = Field(max_length=1000)
    date: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")
    commit: str = Field(max_length=64, pattern=r"^[0-9a-f]+(\+dirty)?$|^unknown$")
    hardware: str = Field(max_length=200)
    torch: str = Field(max_length=60)
    threads: int = Field(ge=0, le=10_000)
    columns: list[str] = Field(max_length=40)
    rows: list[list[str | int | float | None]] = Field(max_length=400)
    notes: str = Field("", max_length=4000)
    source: str | None = Field(None, max_length=300)


class Window(BaseModel):
    """window.json as benchmarks/gpu_window.py writes it (extra keys are kept, not trusted)."""

    model_config = ConfigDict(extra="allow")
    commit: str = Field(min_length=7, max_length=64, pattern=r"^[0-9a-f]+(\+dirty)?$")
    card: str = Field("unknown card", max_length=200)
    seconds: float | None = None
    # the date and minute name the copied logs: a date and a time, nothing a path could be made of
    started: str = Field("", pattern=r"^(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} UTC)?$")
    campaign_step: str | None = Field(None, max_length=100)
    campaign_complete: bool = False
    steps: list[Step] = Field(default_factory=list)
    results: dict[str, Result] = Field(default_factory=dict, max_length=20)


def head_commit() -> str:
    from fedskew.engine.rundir import git_commit

    return git_commit() or "no git commit"


def _regular(path: Path, what: str) -> bool:
    """Whether ``path`` is a regular file within the budget (absent: False); a link or anything else
    is refused."""
    if not os.path.lexists(path):
        return False
    if path.is_symlink() or not path.is_file():
        raise Refused(f"{what} '{path.name}' is not a regular file (a link or a folder); nothing is merged.")
    if path.stat().st_size > MEMBER_BYTES:
        raise Refused(f"{what} '{path.name}' is {path.stat().st_size:,} bytes, over the {MEMBER_BYTES:,} a file may "
                      f"be; nothing is merged.")
    return True


def read_window(files_at: Path) -> Window:
    path = files_at / "window.json"
    if not _regular(path, "window.json"):
        raise Refused(f"'{files_at}' holds no window.json: it is not what benchmarks/gpu_window.py writes.")
    try:
        data: Any = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise Refused(f"window.json is not valid JSON ({str(exc)[:120]}); nothing is merged.") from None
    if not isinstance(data, dict):
        raise Refused(f"window.json holds a {type(data).__name__}, not the job's record (a mapping); nothing is "
                      f"merged.")
    try:
        return Window.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "(the record)"
        raise Refused(f"window.json's '{where}' = {str(err.get('input'))[:80]!r} is not valid ({err['msg']}); "
                      f"nothing is merged.") from None


def extract(tarball: Path, into: Path) -> None:
    """The archive's kept files (``KEEP``: text and SQLite), regular files only, through the ``data``
    filter (no absolute paths, no ``..``, no links out, no special files or set-uid bits), within the
    size budget, written 0644."""
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            members = tar.getmembers()
            total = 0
            keep = []
            for m in members:
                if not m.isreg():
                    continue  # folders are made as needed; links and devices never
                if Path(m.name).suffix not in KEEP:
                    continue
                if m.size > MEMBER_BYTES:
                    raise Refused(f"campaign.tar.gz's member '{m.name[:80]}' is {m.size:,} bytes, over the "
                                  f"{MEMBER_BYTES:,} a file may be; nothing is merged.")
                total += m.size
                if total > TOTAL_BYTES:
                    raise Refused(f"campaign.tar.gz holds over {TOTAL_BYTES:,} bytes of files; nothing is merged.")
                keep.append(m)
            try:
                tar.extractall(into, members=keep, filter="data")
            except tarfile.FilterError as exc:
                why = " ".join(str(exc).split())[:120]
                raise Refused(f"campaign.tar.gz's member '{str(exc.tarinfo.name)[:80]}' is refused ({why}); "
                              f"nothing is merged.") from None
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        why = " ".join(str(exc).split())[:120] or "truncated"
        raise Refused(f"campaign.tar.gz cannot be read ({type(exc).__name__}: {why}); nothing is merged.") from None
    for path in into.rglob("*"):
        if path.is_file():
            if path.stat().st_size > MEMBER_BYTES:  # (a member whose header understated its size)
                raise Refused(f"campaign.tar.gz's member '{path.relative_to(into)}' outgrew its size; nothing is "
                              f"merged.")
            path.chmod(0o644)


def merge(files_at: Path, root: Path, commit: str | None = None) -> str:
    record = read_window(files_at)
    commit = commit or head_commit()
    ran = record.commit
    if not (ran.startswith(commit) or commit.startswith(ran)):  # (full or short hashes)
        raise Refused(f"the job ran commit {ran!r} and this checkout is {commit!r}: its runs are not this code's, "
                      f"so nothing is merged (check out that commit, or run a new job).")
    plan = {s["step"]: s for s in CAMPAIGN + TEST_PLAN}
    step = record.campaign_step
    if step is not None and step not in plan:
        raise Refused(f"the job ran campaign step {step!r}, which is not in the plan "
                      f"({', '.join(plan)}); nothing is merged.")
    tarball = files_at / "campaign.tar.gz"
    has_archive = step is not None and _regular(tarball, "campaign.tar.gz")
    logs = [name for name in LOGS if _regular(files_at / name, name)]
    state = campaign_state(root)
    earlier = [w for w in state["windows"] if w.get("started") == record.started and w.get("commit") == ran]
    if earlier and (not has_archive or any(w.get("archive", True) for w in earlier)):
        raise Refused(f"the job of {record.started} ({ran}) is merged already; nothing is merged again.")
    state["windows"] = [w for w in state["windows"] if w not in earlier]
    state["windows"].append({"started": record.started, "card": record.card, "commit": ran,
                             "seconds": record.seconds, "campaign_step": step, "archive": has_archive})
    for s in record.steps:  # a speed step brought back whole is left out of later windows
        if s.name in SPEED and s.rc == 0 and not s.cut:
            state.setdefault("measured", {})[s.name] = {"started": record.started, "card": record.card, "commit": ran}
    card = "".join(c if c.isalnum() else "-" for c in record.card)[:40]
    stamp = f"{record.started[:10]}-{record.started[11:16].replace(':', '')}-{card}".strip("-") or "window"
    summary = [f"job on {record.card} ({record.seconds} s)"]
    with tempfile.TemporaryDirectory() as tmp:
        got = Path(tmp)
        if has_archive:
            suite = plan[step]["bench"][0]
            scale = plan[step]["bench"][plan[step]["bench"].index("--scale") + 1]
            extract(tarball, got)
            from fedskew.experiments.bench import MARKER
            from fedskew.files import read_yaml

            try:
                claimed = read_yaml(got / MARKER, "suite marker", own=True) if (got / MARKER).is_file() else {}
            except ConfigError:
                claimed = {}
            if not isinstance(claimed, dict) or claimed.get("suite") != suite or claimed.get("scale") != scale:
                raise Refused(f"campaign.tar.gz holds a bench folder of another suite or scale than step {step!r} "
                              f"({suite}, {scale}); nothing is merged.")
            target = root / step
            for db in target.glob("*/results.sqlite"):
                lost = done_runs(db) - done_runs(got / db.parent.name / "results.sqlite")
                if lost:
                    raise Refused(f"campaign.tar.gz lacks {len(lost)} finished runs that {db} holds; nothing is "
                                  f"merged (was the job seeded from another campaign folder?).")
            runs = finished(got)
            # complete: the window says so and the runs are there; anything less is partial
            status = "complete" if record.campaign_complete and runs > 0 else "partial"
            replace_folder(got, target)  # the old step stays whole until the new one is all there
            state["steps"][step] = {"status": status, "about": plan[step]["about"]}
            summary.append(f"campaign step {step}: {status}, {runs} finished runs in {target}")
        elif step is not None:
            summary.append(f"campaign step {step}: no campaign.tar.gz came back, so the step is not recorded (its "
                           f"archive can be merged when it arrives)")
        root.mkdir(parents=True, exist_ok=True)
        from fedskew.engine.durable import atomic_write_text

        atomic_write_text(json.dumps(state, indent=2) + "\n", root / "campaign.json")
        results_dir = ROOT / "benchmarks" / "results" if root == CAMPAIGN_ROOT else root / "results"
        for result in record.results.values():  # each benchmark's figure on this card: docs/performance.md
            results_dir.mkdir(parents=True, exist_ok=True)
            target = results_dir / f"{result.benchmark}-{card.lower()}.json"
            atomic_write_text(json.dumps(result.model_dump(exclude_none=True), indent=1) + "\n", target)
            summary.append(f"{result.benchmark} -> {target}")
        runs_dir = root.parent / "gpu-runs"
        for name in logs:
            runs_dir.mkdir(parents=True, exist_ok=True)
            target_log = runs_dir / f"{stamp}-window-{name}"
            shutil.copyfile(files_at / name, target_log, follow_symlinks=False)
            target_log.chmod(0o644)
            summary.append(f"{name} -> {target_log}")
    if has_archive:
        rebuilt = subprocess.run([sys.executable, "-m", "fedskew.cli", "bench", suite, "--scale", scale, "--out",
                                  str(root / step), "--report"], capture_output=True, text=True, cwd=ROOT)
        summary.append(f"leaderboard: {root / step / 'leaderboard.md'}" if rebuilt.returncode == 0 else
                       f"leaderboard not rebuilt: {rebuilt.stderr.strip()[-300:]}")
        try:  # (the merge is done: a board that cannot be compared is said, not raised)
            ranks = rank_report(root, suite) if rebuilt.returncode == 0 else None
        except ConfigError as exc:
            ranks = f"not written: {exc}"
        if ranks is not None:
            summary.append(f"paper scale against the lite board: {ranks}")
    assert re.fullmatch(r"[\w-]+", stamp)  # (the schema allows nothing else into a file name)
    return "; ".join(summary)


def rank_report(root: Path, suite: str, boards: Path = LITE_BOARDS) -> Path | None:
    """How far the suite's committed lite board predicts its paper-scale campaign: the leaderboards
    of the campaign's steps of ``suite`` (joined: each step ran some of the methods) against
    ``boards/<suite>-lite.md``, Kendall's tau-b with its p-value and the methods that move most, per
    ranked table and setting (:func:`fedskew.experiments.bench.board_agreement`), written to
    ``root/<suite>-paper-vs-lite.md``. None when either side has no board."""
    from fedskew.engine.durable import atomic_write_text
    from fedskew.experiments.bench import board_agreement
    from fedskew.files import read_text

    steps = [s["step"] for s in CAMPAIGN if s["bench"][0] == suite and (root / s["step"] / "leaderboard.md").is_file()]
    lite = boards / f"{suite}-lite.md"
    if not steps or not lite.is_file():
        return None
    state = campaign_state(root)["steps"]
    lines = board_agreement([read_text(root / s / "leaderboard.md", "campaign board") for s in steps],
                            read_text(lite, "lite board"), "at paper scale", "on the lite board")
    done = ", ".join(f"[{s}]({s}/leaderboard.md) ({state.get(s, {}).get('status', 'not merged')})" for s in steps)
    text = (f"# {suite}: the paper-scale campaign against the lite board\n\nGenerated by benchmarks/gpu_merge.py "
            f"from the leaderboards of the campaign's steps ({done}) and the committed "
            f"[lite board](../leaderboards/{suite}-lite.md): for each ranked table and setting that both show, "
            f"Kendall's tau-b between the two boards' means over the methods both rank (1: the same order; 0: no "
            f"association), its two-sided p-value, and the methods whose rank among them moves most. Users choose "
            f"methods from the "
            f"cheap boards; this says how far those predict the expensive ones.\n\n"
            + ("\n".join(f"- {line}" for line in lines) if lines else
               "No ranked table and setting has 3 or more methods with a mean on both boards yet.") + "\n")
    target = root / f"{suite}-paper-vs-lite.md"
    atomic_write_text(text, target)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files_at", type=Path, nargs="?", help="the folder the job's files came back to")
    p.add_argument("--campaign-root", type=Path, default=CAMPAIGN_ROOT)
    p.add_argument("--ranks", metavar="SUITE", choices=sorted({s["bench"][0] for s in CAMPAIGN}),
                   help="merge nothing: write the suite's paper-scale campaign against its lite board again "
                        "(after the lite board changed)")
    args = p.parse_args(argv)
    if args.ranks:
        try:
            print(rank_report(args.campaign_root, args.ranks) or f"gpu_merge: no campaign board or lite board of "
                                                                    f"{args.ranks} to compare")
        except ConfigError as exc:
            print(f"gpu_merge: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.files_at is None:
        p.error("give FILES_AT (the folder the job's files came back to), or --ranks SUITE")
    try:
        print(merge(args.files_at, args.campaign_root))
    except (Refused, ConfigError) as exc:
        print(f"gpu_merge: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
