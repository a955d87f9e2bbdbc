"""How long the test suite takes: the full suite (what CI runs) and the fast subset, one after the other.

    python benchmarks/suite_time.py --json benchmarks/results/suite-time.json

Runs ``python -m pytest`` and ``python -m pytest -m "not slow"`` in this checkout, prints each one's
wall time and pytest's count line, and with --json writes them for docs/performance.md, README and
CONTRIBUTING (their times are generated blocks: benchmarks/front_page.py rewrites them). A run that
fails is reported as failed, with its time; nothing is hidden.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = {"full suite": [sys.executable, "-m", "pytest"],
        "fast subset": [sys.executable, "-m", "pytest", "-m", "not slow"]}


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=sorted(RUNS), help="time one of the two")
    p.add_argument("--json", help="also write the figures to this JSON file (for docs/performance.md)")
    args = p.parse_args()
    rows = []
    for name, cmd in RUNS.items():
        if args.only and name != args.only:
            continue
        t0 = time.monotonic()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        seconds = time.monotonic() - t0
        tail = [ln for ln in done.stdout.splitlines() if re.search(r"\b(passed|failed)\b", ln)]
        counts = re.sub(r"=+", "", tail[-1]).strip() if tail else f"exit status {done.returncode}"
        counts = re.sub(r" in [\d.]+s.*$", "", counts)
        rows.append([name, minutes(seconds), round(seconds), counts, "passed" if done.returncode == 0 else "FAILED"])
        print(f"{name}: {minutes(seconds)} ({counts}; exit {done.returncode})", flush=True)
    if args.json:
        from common import write_result

        write_result(args.json, "suite-time", "How long the test suite takes",
                     ["run", "wall time (m:ss)", "seconds", "pytest's count", "result"], rows,
                     "Two pytest workers (`-n 2`, pyproject's options), one after the other on an otherwise idle "
                     "machine; two runs of one tree on one machine differ by up to two minutes.")
        from front_page import rewrite

        rewrite(str(Path(args.json).resolve().relative_to(ROOT)))  # README's and CONTRIBUTING's times


if __name__ == "__main__":
    main()
