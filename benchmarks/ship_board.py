"""Commit a board with the runs it was built from, so that every cell of it recomputes.

    fedskew bench niid-bench --scale lite --data DATA_DIR --out /tmp/niid      # on a clean checkout
    python benchmarks/ship_board.py /tmp/niid niid-bench-lite

writes docs/leaderboards/niid-bench-lite.md and .html (the suite folder's leaderboard) and
docs/leaderboards/niid-bench-lite/: the suite's marker (bench.yaml), a manifest (the rebuild command
and title the board names) and, per part, its sweep.yaml and its results database without the
per-round curves (the board reads the runs' summaries only), gzip-compressed. tests/test_evidence.py
unpacks each shipped folder, rebuilds the board from it with `fedskew bench ... --report`'s code and
compares it with the committed page, to the last character.
"""

from __future__ import annotations

import argparse
import gzip
import re
import shutil
import sqlite3
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
BOARDS = ROOT / "docs" / "leaderboards"
MANIFEST = "board.yaml"


def compact(db_path: Path, out: Path) -> None:
    """``db_path`` without its per-round rows, vacuumed, gzip-compressed to ``out`` (no timestamp in
    the gzip header, so the same database gives the same bytes)."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "results.sqlite"
        shutil.copyfile(db_path, copy)
        db = sqlite3.connect(copy)
        db.execute("DELETE FROM rounds")
        db.commit()
        db.execute("VACUUM")
        db.close()
        with open(copy, "rb") as src, open(out, "wb") as raw, \
                gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as dst:
            shutil.copyfileobj(src, dst)


def unpack(shipped: Path, dest: Path) -> Path:
    """A suite folder that ``fedskew bench --report`` can rebuild, from a shipped folder."""
    shutil.copytree(shipped, dest)
    for gz in dest.rglob("results.sqlite.gz"):
        with gzip.open(gz, "rb") as src, open(gz.with_suffix(""), "wb") as dst:
            shutil.copyfileobj(src, dst)
        gz.unlink()
    return dest


def manifest_of(board_md: str) -> dict:
    """The title and the rebuild command a board names (its first line and its 'Rebuild:' command)."""
    title = board_md.splitlines()[0].removeprefix("# ").strip()
    command = re.search(r"Rebuild: `([^`]*)`", board_md)
    return {"title": title, "command": command.group(1) if command else None}


def ship(suite_dir: Path, name: str) -> Path:
    marker = yaml.safe_load((suite_dir / "bench.yaml").read_text())
    board_md = (suite_dir / "leaderboard.md").read_text()
    dest = BOARDS / name
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    shutil.copyfile(suite_dir / "bench.yaml", dest / "bench.yaml")
    (dest / MANIFEST).write_text(yaml.safe_dump({**marker, **manifest_of(board_md), "folder": str(suite_dir)},
                                                sort_keys=False))
    for db in sorted(suite_dir.glob("*/results.sqlite")):
        part = dest / db.parent.name
        part.mkdir()
        shutil.copyfile(db.parent / "sweep.yaml", part / "sweep.yaml")
        compact(db, part / "results.sqlite.gz")
    shutil.copyfile(suite_dir / "leaderboard.md", BOARDS / f"{name}.md")
    shutil.copyfile(suite_dir / "leaderboard.html", BOARDS / f"{name}.html")
    return dest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite_dir", help="the suite folder fedskew bench wrote (its --out)")
    p.add_argument("name", help="the board's name under docs/leaderboards/, e.g. niid-bench-lite")
    args = p.parse_args()
    dest = ship(Path(args.suite_dir), args.name)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"docs/leaderboards/{args.name}.md and {dest.relative_to(ROOT)}/ ({size / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
