"""Rebuild README's table, the tutorials' tables and the front-page figure from the sweeps they quote.

    fedskew sweep --out /tmp/front                # the default comparison, on a clean checkout
    python benchmarks/front_page.py /tmp/front
    python examples/custom_method.py              # the own-method tutorial's sweep
    python benchmarks/front_page.py runs/sweep-logitnorm-vs-fedavg --as docs/evidence/own-method.jsonl

exports the sweep's runs to docs/evidence/sweep-digits.jsonl (fedskew.experiments.evidence), copies
its curves figure to docs/images/sweep-digits-curves.png and rewrites every block of README.md and
docs/ marked ``<!-- generated from docs/evidence/sweep-digits.jsonl ...: do not edit -->`` from the
exported runs. tests/test_evidence.py rebuilds the blocks from the committed file and compares.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from fedskew.engine.durable import atomic_write_text
from fedskew.experiments.evidence import BLOCK, export_runs, refresh

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "docs/evidence/sweep-digits.jsonl"


def pages(root: Path = ROOT) -> list[Path]:
    """Every page that holds a generated block."""
    found = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return [p for p in found if "generated" not in p.relative_to(root).parts and BLOCK.search(p.read_text())]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep_dir", help="the folder `fedskew sweep --out` wrote")
    p.add_argument("--as", dest="source", default=SOURCE, help=f"the export it becomes (default {SOURCE})")
    args = p.parse_args()
    sweep = Path(args.sweep_dir)
    rows = export_runs(sweep, ROOT / args.source)
    print(f"{len(rows)} runs -> {args.source}")
    curves = sweep / "report" / "curves_p0.png"
    if curves.is_file() and args.source == SOURCE:
        shutil.copyfile(curves, ROOT / "docs" / "images" / "sweep-digits-curves.png")
    rewrite(args.source)


def rewrite(source: str) -> None:
    """Rebuild every block of README and docs/ whose source is ``source``."""
    for page in pages():
        text = page.read_text()
        new = refresh(text, ROOT, only=source)
        if new != text:
            atomic_write_text(new, page)
            print(f"rewrote {page.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
