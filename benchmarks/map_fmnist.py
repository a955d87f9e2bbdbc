"""FedAvg, FedRS, FedPHP, MAP and the personalised baselines (Ditto, DittoRS, FedRep, FedBABU,
FedROD, FedProto, FedLC, pFedMe, Per-FedAvg, FedPer, LG-FedAvg, APFL, FedALA, FedFOMO, FedPAC) and the
generic ones of issue 22 (FedDecorr, CCVR, FedNH, FedDF, FedETF) on real Fashion-MNIST with the MAP partition (MAP
paper, Tables I/II FaMnist columns, at CPU scale).

    python benchmarks/map_fmnist.py --data DATA_DIR
    python benchmarks/map_fmnist.py --data DATA_DIR --methods ditto fedrep fedproto
    python benchmarks/map_fmnist.py --data DATA_DIR --rounds 150 --subsample 1 --model lenet

Setting (paper unless noted): ``random_classes`` partition (each client draws its number of classes
from {2..10}), 100 clients, 20% per round, 20% of each client's data held out as its local test
split, SGD lr 0.03 momentum 0.9 weight decay 1e-5, batch 64, E = 5, bias-free classifier; MLP
784-200-200 (the paper's MLPNet is 784-1024-1024-128: ``--hidden 1024 1024 128``). CPU scale:
``--subsample`` of the 60,000 training images and ``--rounds`` rounds.

Reported, mean +- std over seeds: aggregation accuracy (global model, global test set: last round
and mean of the last 10), personalisation accuracy of the clients selected in each round (the
paper's figure; mean over the last 10 rounds) for the newly downloaded model ("before") and the
personalised model ("after"), and after the last round over all 100 clients (each trains once more
from the final global model). ``--hist`` writes the per-client change of the final personalised
accuracy vs FedAvg as a histogram (paper Figure 10).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from common import mean_std, parser
from fedskew.algorithms import METHODS as REGISTERED
from fedskew.config import load_config
from fedskew.engine.runner import run

# label -> options; a label is a method name or "<method>-<variant>": every registered method at its
# defaults (fedskew.algorithms.METHODS: a new method is here by being registered), then these.
# The MAP family at its defaults (alpha 0.9, KD lambda 0.01, MAP on the authors' code schedule,
# FedPHP one stage, a bias-free classifier); the "-paper" variants are MAP's Algorithm 1 schedule and
# the alpha 0.5 used before issue 17.
SETTINGS = {"fedrs-a05": ["method.alpha=0.5"], "map-paper": ["method.alpha=0.5", "method.schedule=paper"],
            # personalised baselines (MAP paper Table II); defaults unless noted
            "ditto": ["method.lam=0.1"], "dittors": ["method.lam=0.1"],
            "fedrep": ["method.head_fraction=0.5"], "fedbabu": ["method.finetune_fraction=1.0"],
            "fedproto": ["method.lam=1.0", "model.classifier_bias=true"], "fedlc": ["method.tau=1.0"],
            # pFedMe's paper runs plain SGD: with momentum 0.9 its w-step lr * lam (w - theta) is
            # amplified tenfold
            "pfedme": ["method.lam=15", "method.personal_lr=0.01", "momentum=0"],
            "perfedavg": ["method.alpha=0.01"]}
METHODS = {**{name: [] for name in sorted(REGISTERED)}, **SETTINGS}
BASE_METHODS = ["fedavg", "fedrs", "fedphp", "map"]


def mean_last(history, key, n=10):
    vals = [h[key] for h in history if h.get(key) is not None][-n:]
    return sum(vals) / len(vals)




def pct(v) -> str:
    return "none" if v is None else f"{100 * v:.2f}"


def main():
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--subsample", type=float, default=0.2)
    p.add_argument("--model", default="mlp")
    p.add_argument("--hidden", type=int, nargs="+", default=[200, 200])
    p.add_argument("--methods", nargs="+", default=BASE_METHODS,
                   help=f"labels among {list(METHODS)}")
    p.add_argument("--hist", default=None, help="PNG path for the per-client change vs FedAvg (Figure 10)")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="map_fmnist_"))
    common = ["dataset=fmnist", f"dataset.root={args.data}", f"dataset.train_subsample={args.subsample}",
              f"model={args.model}", "model.classifier_bias=false", "partition=random_classes",
              "partition.num_clients=100", "clients_per_round=20", "partition.local_test_fraction=0.2",
              f"rounds={args.rounds}", f"local_epochs={args.epochs}", "batch_size=64", "lr=0.03",
              "momentum=0.9", "weight_decay=1e-5", "executor=vectorized", "final_personalization=true"]
    if args.model == "mlp":
        common.append(f"model.hidden=[{','.join(map(str, args.hidden))}]")
    print("settings:", " ".join(common), flush=True)
    rows = []
    for method in args.methods:
        for seed in args.seeds:
            t0 = time.perf_counter()
            res = run(load_config(None, common + [f"method={method.split('-')[0]}", *METHODS[method], f"seed={seed}"]),
                      out / f"{method}-s{seed}")
            s, h = res.summary, res.history
            rows.append({"method": method, "seed": seed, "agg_last": s["global/test_acc"],
                         "agg_last10": s["global/test_acc_mean_last10"],
                         "pers_before": mean_last(h, "personal/acc_before"),
                         "pers_after": mean_last(h, "personal/acc_after"),
                         "all_before": s["personal/final_acc_before"], "all_after": s["personal/final_acc_after"],
                         "per_client": s["personal/final_acc_after_per_client"]})
            r = rows[-1]
            print(f"{method} seed {seed}: agg {pct(r['agg_last'])} (last10 {pct(r['agg_last10'])}) "
                  f"pers before/after {100 * r['pers_before']:.2f}/{100 * r['pers_after']:.2f} "
                  f"all clients {100 * r['all_before']:.2f}/{100 * r['all_after']:.2f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2))

    print("\n| method | options | aggregation, last (%) | aggregation, last 10 (%) | personal before (%) "
          "| personal after (%) | all clients after (%) |")
    print("|---|---|---|---|---|---|---|")
    for method in args.methods:
        rs = [r for r in rows if r["method"] == method]
        print(f"| {method} | {' '.join(METHODS[method]) or 'defaults'} | {mean_std([r['agg_last'] for r in rs])} "
              f"| {mean_std([r['agg_last10'] for r in rs])} | {mean_std([r['pers_before'] for r in rs])} "
              f"| {mean_std([r['pers_after'] for r in rs])} | {mean_std([r['all_after'] for r in rs])} |")

    if args.hist and "fedavg" in args.methods:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for method in [m for m in args.methods if m != "fedavg"]:
            diffs = []
            for seed in args.seeds:
                base = next(r for r in rows if r["method"] == "fedavg" and r["seed"] == seed)["per_client"]
                mine = next(r for r in rows if r["method"] == method and r["seed"] == seed)["per_client"]
                diffs += [100 * (a - b) for a, b in zip(mine, base) if a is not None and b is not None]
            ax.hist(diffs, bins=30, alpha=0.5, label=method)
        ax.axvline(0, color="k", lw=0.8)
        ax.set_xlabel("per-client personalised accuracy minus FedAvg's (points)")
        ax.set_ylabel("clients x seeds")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.hist, dpi=120)
        print(f"histogram: {args.hist}")
    print(f"\nrun directories and results.json in {out}")


if __name__ == "__main__":
    main()
