"""What the Fashion-MNIST benchmark scripts share: the command-line skeleton and mean +- std.

Imported as ``common`` (the scripts run as ``python benchmarks/<name>.py``, which puts this folder
first on the import path)."""

from __future__ import annotations

import argparse
import os
import statistics


def parser(doc: str) -> argparse.ArgumentParser:
    """--data (the folder with Fashion-MNIST), --seeds, --out; each script adds its own."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get("FEDSKEW_DATA", "data"),
                   help="folder holding Fashion-MNIST's IDX files (default $FEDSKEW_DATA, else ./data)")
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


# -- results the performance page is generated from ------------------------------------------------------

RESULTS = "benchmarks/results"  # one JSON file per benchmark and device: docs/performance.md is built from them


def hardware(device: str = "cpu") -> str:
    """The machine in words: the CPU's model name and core count, or the GPU's name."""
    import os
    import platform

    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    name = platform.processor() or "CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            name = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def commit() -> str:
    """The checkout's commit (12 hex digits), '+dirty' when its tracked files differ from it."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def write_result(path, benchmark: str, title: str, columns: list[str], rows: list[list], notes: str = "",
                 device: str = "cpu") -> None:
    """``path``: one benchmark's current figure as JSON (what ran it, where, when, at which commit, and
    its table); ``benchmarks/evidence_pages.py`` renders every such file into docs/performance.md."""
    import datetime
    import json
    import shlex
    import sys
    from pathlib import Path

    import torch

    argv = list(sys.argv[1:])
    for i, a in enumerate(argv[:-1]):  # (where the data lay on the measuring machine is no one else's path)
        if a == "--data":
            argv[i + 1] = "DATA_DIR"
        if a == "--json":
            argv[i + 1] = f"{RESULTS}/{Path(argv[i + 1]).name}"
    record = {"benchmark": benchmark, "title": title,
              "command": "python " + " ".join(shlex.quote(a) for a in ["benchmarks/" + Path(sys.argv[0]).name,
                                                                       *argv]),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "commit": commit(), "hardware": hardware(device), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "columns": columns,
              "rows": [[round(v, 4) if isinstance(v, float) else v for v in r] for r in rows], "notes": notes}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
