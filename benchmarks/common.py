"""What the Fashion-MNIST benchmark scripts share: the command-line skeleton and mean +- std.

Imported as ``common`` (the scripts run as ``python benchmarks/<name>.py``, which puts this folder
first on the import path)."""

from __future__ import annotations

import argparse
import statistics


def parser(doc: str) -> argparse.ArgumentParser:
    """--data (the folder with Fashion-MNIST), --seeds, --out; each script adds its own."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="../shared/data", help="folder holding Fashion-MNIST's IDX files")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=None, help="folder for run directories and results.json (default: a temp dir)")
    return p


def mean_std(vals, scale: float = 100.0) -> str:
    """'mean +- sample std' of the values that are not None, times ``scale``; '-' when none."""
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return f"{scale * statistics.mean(vals):.2f} +- {scale * sd:.2f}"
