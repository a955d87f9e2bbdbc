"""FedMR vs FedAvg on real Fashion-MNIST under pcdd P5C2 and P10C2 (FedMR paper, Table 1 setting
at CPU scale).

    python benchmarks/fedmr_fmnist.py --data DATA_DIR            # the table, 3 seeds
    python benchmarks/fedmr_fmnist.py --data DATA_DIR --grid     # mu1 x mu2 grid on seed 0 first

Every run goes through the library (``fedskew.engine.runner.run``) with the same settings for both
methods (same partition, client schedule and batch order per seed). Reported: the last-round
``global/test_acc`` and the mean of the last 10 evaluations, mean +- std over seeds.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from common import mean_std, parser
from fedskew.config import load_config
from fedskew.engine.runner import run


def settings(data: str, clients: int, rounds: int, subsample: float, epochs: int) -> list[str]:
    return ["dataset=fmnist", f"dataset.root={data}", f"dataset.train_subsample={subsample}",
            "model=simplecnn", "partition=pcdd", f"partition.num_clients={clients}",
            "partition.classes_per_client=2", f"clients_per_round={clients}", f"rounds={rounds}",
            f"local_epochs={epochs}", "batch_size=64", "lr=0.01", "momentum=0.9", "weight_decay=1e-5",
            "executor=vectorized", "final_personalization=false", "partition.local_test_fraction=0"]


def one(args, out: Path, clients: int, method: list[str], seed: int) -> dict:
    cfg = load_config(None, settings(args.data, clients, args.rounds, args.subsample, args.epochs)
                      + method + [f"seed={seed}"])
    t0 = time.perf_counter()
    res = run(cfg, out / f"P{clients}C2-{'-'.join(method)}-s{seed}".replace("=", ""))
    s = res.summary
    return {"clients": clients, "method": " ".join(method), "seed": seed, "last": s["global/test_acc"],
            "last10": s["global/test_acc_mean_last10"], "best": s["global/test_acc_best"],
            "extra_pct": s["comm/extra_pct"], "seconds": time.perf_counter() - t0}




def main():
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--subsample", type=float, default=0.1, help="share of the 60,000 training images kept")
    p.add_argument("--clients", type=int, nargs="+", default=[5, 10])
    p.add_argument("--mu1", type=float, default=0.01)
    p.add_argument("--mu2", type=float, default=1e-4)
    p.add_argument("--grid", action="store_true", help="first search mu1 x mu2 on seed 0 (by last-10 mean)")
    p.add_argument("--no-fedavg", action="store_true", help="run only the FedMR variant(s)")
    p.add_argument("--fedmr-args", nargs="*", default=[],
                   help="extra FedMR options, e.g. method.intra_form=code (overrides mu1/mu2 if given)")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="fedmr_fmnist_"))
    print(f"settings: {' '.join(settings(args.data, 'K', args.rounds, args.subsample, args.epochs))}", flush=True)
    rows = []
    best = {k: (args.mu1, args.mu2) for k in args.clients}
    if args.grid:
        for clients in args.clients:
            scores = {}
            for mu1 in (1e-3, 1e-2):
                for mu2 in (1e-4, 1e-3):
                    r = one(args, out / "grid", clients, ["method=fedmr", f"method.mu1={mu1}", f"method.mu2={mu2}"], 0)
                    scores[(mu1, mu2)] = r["last10"]
                    print(f"grid P{clients}C2 mu1={mu1} mu2={mu2}: last10 {100 * r['last10']:.2f}", flush=True)
            best[clients] = max(scores, key=scores.get)
            print(f"chosen for P{clients}C2: mu1={best[clients][0]} mu2={best[clients][1]}", flush=True)
    for clients in args.clients:
        mu1, mu2 = best[clients]
        variants = [] if args.no_fedavg else [["method=fedavg"]]
        variants.append(["method=fedmr", f"method.mu1={mu1}", f"method.mu2={mu2}", *args.fedmr_args])
        for method in variants:
            for seed in args.seeds:
                r = one(args, out, clients, method, seed)
                rows.append(r)
                print(f"P{clients}C2 {r['method']} seed {seed}: last {100 * r['last']:.2f} "
                      f"last10 {100 * r['last10']:.2f} ({r['seconds']:.0f}s)", flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    print("\n| partition | method | last-round acc (%) | mean of last 10 (%) | extra comm (%) |")
    print("|---|---|---|---|---|")
    for clients in args.clients:
        for method in sorted({r["method"] for r in rows if r["clients"] == clients}):
            sel = [r for r in rows if r["clients"] == clients and r["method"] == method]
            print(
                f"| P{clients}C2 | {method} | {mean_std([r['last'] for r in sel])} "
                f"| {mean_std([r['last10'] for r in sel])} "
                f"| {sel[0]['extra_pct']:.2f} |"
            )
    print(f"\nrun directories and results.json in {out}")


if __name__ == "__main__":
    main()
