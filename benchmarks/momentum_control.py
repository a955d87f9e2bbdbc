"""The label-skew suite's lite setting with FedAvg under the client optimiser of FedCM, GHBM,
LocalGHBM and FedHBM: is what they gain in the suite their server/client rule, or their local SGD?

The suite (``fedskew bench label-skew --scale lite``) runs every method with SGD momentum 0.9 at
lr 0.01 x {1/3, 1, 3}, except these four, whose client optimiser is their own
(``Method.own_optimiser``: plain SGD at lr 0.1 x {1/3, 1, 3}, weight decay 1e-4, their
``run_defaults``). This sweep runs, in the suite's setting and with its selection (3 trials on seed
0 on the validation hold-out, the chosen one on seeds 1 and 2), the four beside FedAvg twice: with
the suite's optimiser (``fedavg``) and with theirs (``fedavg-sgd``, the baseline of the report's
wins/ties/losses). The spec is built from the suite's own (``bench.label_skew``), so the setting,
partitions and trials are the suite's to the letter.

    OMP_NUM_THREADS=1 python benchmarks/momentum_control.py --data DATA_DIR --out DIR --jobs 2

The sweep lies in ``DIR/label-skew-fmnist`` (resumable: run it again to finish it), and its board,
the suite's (``DIR/leaderboard.md`` and ``.html``: the methods x settings tables with ranks and
wins/ties/losses against ``fedavg-sgd`` by paired t-test over the seeds, and the selection's
choices); docs/leaderboards/momentum-control-lite.md is that board.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import fedskew
from fedskew.algorithms import registered
from fedskew.experiments.bench import label_skew, suite_method, write_leaderboard

OWN = sorted(n for n, c in registered().items() if c.own_optimiser)


def spec(data: str) -> dict:
    """The suite's lite spec for FedAvg and the four, plus FedAvg under their optimiser."""
    suite = label_skew("fmnist", "lite", data, ["fedavg", *OWN])
    theirs = registered()[OWN[0]].run_defaults  # (the four share one: tests/test_bench.py)
    control = suite_method("fedavg", 3, {**suite["base"], "lr": theirs["lr"]})
    control.update(label="fedavg-sgd", config={k: v for k, v in theirs.items() if k != "lr"})
    return {**suite, "name": "momentum-control lite", "methods": [*suite["methods"], control],
            "report": {**suite["report"], "baseline": "fedavg-sgd"}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get("FEDSKEW_DATA", "data"),
                   help="folder holding Fashion-MNIST (default $FEDSKEW_DATA, else ./data)")
    p.add_argument("--out", default="runs/momentum-control")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--report", action="store_true", help="only rebuild the board from the runs there are")
    args = p.parse_args()
    if not args.report:
        fedskew.sweep(spec(args.data), args.jobs, Path(args.out) / "label-skew-fmnist", pack="off", progress=True)
    md, *_ = write_leaderboard("label-skew", "lite", "OMP_NUM_THREADS=1 python benchmarks/momentum_control.py "
                                 "--data DATA_DIR --out DIR --jobs 2", args.out,
                                 title="FedAvg under the client optimiser of FedCM and the GHBM family, in the "
                                       "label-skew suite's lite setting")
    print(f"leaderboard: {md}")


if __name__ == "__main__":
    main()
