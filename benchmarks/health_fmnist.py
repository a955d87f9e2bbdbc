"""Method health on real Fashion-MNIST: every registered method at its default options, P10C2.

    python benchmarks/health_fmnist.py --data DATA_DIR --jobs 2
    python benchmarks/health_fmnist.py --methods fedavg fedmr --seeds 0
    python benchmarks/health_fmnist.py --methods ghbm fedhbm --set lr=0.1 momentum=0 weight_decay=1e-4 \
        --clients 20 --per-round 5
    python benchmarks/health_fmnist.py --methods fedavg fedcac --personal

The setting is the CPU-scale Fashion-MNIST one of docs/benchmarks.md (pcdd P10C2, SimpleCNN, 10%
of the training set, every client every round, 20 rounds of E = 1, B = 64, lr 0.01, momentum 0.9,
weight decay 1e-5; 20% of each client's data held out as its local test split so that methods
without a global model have a number too). Every method in the registry runs with no option set
(a method registered later joins automatically), 3 seeds, through the sweep machinery (SQLite
results in --out, resumable: run it again to finish an interrupted benchmark). Printed: the mean
of the last 5 global accuracies and the last round's personalised accuracy (mean +- std over
seeds), the difference to FedAvg, and how many seeds diverged or ended near chance (< 0.2).

Variants (issue 48's measurements): ``--set key=value`` sets a key for every method, FedAvg
included (``lr=0.1 momentum=0 weight_decay=1e-4`` is the GHBM family's and FedCM's official local
SGD, their ``run_defaults``); ``--clients N --per-round K``
partitions over N clients (P N C2) with K a round; ``--personal`` holds out 20 % of each client's
data as its local test split and runs the final pass, printing its before/after accuracy.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from common import mean_std, parser
from fedskew.algorithms import METHODS
from fedskew.experiments.sweep import load_spec, run_sweep

SETTING = {"dataset": {"name": "fmnist", "train_subsample": 0.1}, "model": "simplecnn",
           "partition": {"name": "pcdd", "num_clients": 10, "classes_per_client": 2},
           "clients_per_round": "all", "rounds": 20, "local_epochs": 1, "batch_size": 64, "lr": 0.01,
           "momentum": 0.9, "weight_decay": 1e-5, "executor": "vectorized", "final_personalization": False,
           "checkpoint_every": 20}
CHANCE = 0.2


def setting(args) -> dict:
    """SETTING with the data folder and the variants' changes (module docstring)."""
    import yaml

    base = {**SETTING, "dataset": {**SETTING["dataset"], "root": args.data},
            "partition": {**SETTING["partition"], "num_clients": args.clients}}
    if args.per_round:
        base["clients_per_round"] = args.per_round
    if args.personal:
        base["partition"]["local_test_fraction"] = 0.2
        base["final_personalization"] = True
    for item in args.set:
        key, _, value = item.partition("=")
        node = base
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return base


def main():
    p = parser(__doc__)
    p.add_argument("--methods", nargs="+", default=sorted(METHODS))
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="set a key for every method")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--per-round", type=int, default=None, help="clients a round (default: all)")
    p.add_argument("--personal", action="store_true", help="local test splits and the final pass")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="health_fmnist_"))
    base = setting(args)
    methods = ["fedavg"] + [m for m in args.methods if m != "fedavg"]
    spec = load_spec({"name": "health-fmnist", "base": base, "methods": methods, "seeds": args.seeds,
                      "partitions": {"P10C2": {}}})
    t0 = time.perf_counter()
    db = run_sweep(spec, out, jobs=args.jobs,
                   on_event=lambda event, r: print(f"{event}: {r['label']} seed {r['seed']}", flush=True))
    print(f"{len(methods) * len(args.seeds)} runs in {time.perf_counter() - t0:.0f} s; results in {out}")
    rows = {}
    for r in db.execute("SELECT label, seed, status, summary, error FROM runs"):
        rows.setdefault(r["label"], []).append(r)

    def values(label, key):
        return [json.loads(r["summary"])[key] for r in rows.get(label, []) if r["status"] == "done"]

    def last5(label):
        out_ = []
        for r in rows.get(label, []):
            if r["status"] != "done":
                continue
            accs = [json.loads(m["metrics"]).get("global/test_acc") for m in db.execute(
                "SELECT metrics FROM rounds WHERE run_id = (SELECT run_id FROM runs WHERE label=? AND seed=?) "
                "ORDER BY round DESC LIMIT 5", (label, r["seed"]))]
            out_.append(None if None in accs else sum(accs) / len(accs))
        return out_

    base5 = [v for v in last5("fedavg") if v is not None]
    base_mean = sum(base5) / len(base5) if base5 else None
    print("\n| method | global, mean of last 5 (%) | vs FedAvg (points) | personalised (%) | diverged or near chance |"
          + (" final pass before (%) | final pass after (%) |" if args.personal else ""))
    print("|---|---|---|---|---|" + ("---|---|" if args.personal else ""))
    for label in methods:
        g = last5(label)
        known = [v for v in g if v is not None]
        gain = f"{100 * (sum(known) / len(known) - base_mean):+.2f}" if known and base_mean is not None else "-"
        personal = values(label, "personal/acc_after")
        bad = sum(r["status"] != "done" for r in rows.get(label, [])) + sum(v is not None and v < CHANCE for v in g)
        glob = mean_std(g) if known else "none (no global model)"
        final = (f" {mean_std(values(label, 'personal/final_acc_before'))} |"
                 f" {mean_std(values(label, 'personal/final_acc_after'))} |") if args.personal else ""
        print(f"| {label} | {glob} | {gain} | {mean_std(personal)} | {bad}/{len(rows.get(label, []))} |{final}")


if __name__ == "__main__":
    main()
