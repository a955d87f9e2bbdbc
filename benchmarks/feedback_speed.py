"""How fast the command line answers a newcomer, against importing torch alone.

A misspelt method and ``fedskew bench --list`` should answer within 1.2 x the time of
``python -c "import torch"`` on the same machine: fedskew's own work beyond importing torch is what
this measures. fedskew's commands freeze torch's objects for the garbage collector (``gc.freeze``), which
spares them the collector's last pass at exit that a bare ``import torch`` pays; the last column compares
them with a bare import that does the same, so it holds fedskew's own work alone. The commands run
interleaved, ``--repeats`` times each, and the medians are compared, so a noisy machine moves all alike.
The commands run as on a user's machine: Python caches each module's compiled bytecode (an environment
that sets PYTHONDONTWRITEBYTECODE, as some containers do, would compile fedskew's modules from source on
every command, about 0.2 s); one unmeasured round first writes the caches.

    python benchmarks/feedback_speed.py --repeats 7
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    # (what fedskew's commands do after importing torch: the garbage collector's passes, the last one at exit
    # included, no longer scan torch's objects; the share of the time that is fedskew's own work)
    "import torch; gc.freeze()": [sys.executable, "-c", "import gc, torch; gc.freeze()"],
    "fedskew run method=fedmrr (a typo)": [sys.executable, "-m", "fedskew.cli", "run", "method=fedmrr"],
    "fedskew bench --list": [sys.executable, "-m", "fedskew.cli", "bench", "--list"],
    "fedskew methods": [sys.executable, "-m", "fedskew.cli", "methods"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="also write the figures to this JSON file (for docs/performance.md)")
    args = parser.parse_args()
    times = {name: [] for name in COMMANDS}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryDirectory() as cwd:
        for i in range(args.repeats + 1):
            for name, cmd in COMMANDS.items():
                t0 = time.perf_counter()
                subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, check=False)
                if i:  # (the first round writes the bytecode caches)
                    times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["import torch"])
    frozen = statistics.median(times["import torch; gc.freeze()"])
    print("| command | median (s) | / import torch | / import torch; gc.freeze() |\n|---|---|---|---|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| `{name}` | {m:.2f} | {m / base:.2f} x | {m / frozen:.2f} x |")
    if args.json:
        from common import write_result

        write_result(args.json, "command-line", "How fast the command line answers",
                     ["command", "median (s)", "/ import torch", "/ import torch; gc.freeze()"],
                     [[name, statistics.median(ts), statistics.median(ts) / base, statistics.median(ts) / frozen]
                      for name, ts in times.items()],
                     f"each command {args.repeats} times, interleaved, the median; the target: a typo and "
                     f"`fedskew bench --list` within 1.2 x a bare `import torch; gc.freeze()`.")


if __name__ == "__main__":
    main()
