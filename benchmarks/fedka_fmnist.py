"""FedAvg, FedNTD and FedKA on real Fashion-MNIST, Dirichlet alpha 0.1, 10 clients, t-CNN (FedKA
paper, Table 2 layout, at CPU scale), with the forgetting degree by class role.

    python benchmarks/fedka_fmnist.py --data DATA_DIR
    python benchmarks/fedka_fmnist.py --data DATA_DIR --rounds 100 --epochs 10 --subsample 1

Setting (paper unless noted): 10 clients, all selected each round, Dirichlet alpha 0.1, t-CNN
(3x3 kernels: the paper gives none), SGD lr 0.01 momentum 0.9 weight decay 1e-5, batch 128,
anchor cap 10, FedKA beta 0.001 (its default; paper grid 0.5..0.001; ``fedka-b01``: 0.1), FedNTD
beta 1, tau 1 (reference defaults).
CPU scale: ``--subsample`` of the 60,000 training images, ``--epochs`` (paper 10), ``--rounds``
(paper 100); the forgetting degree on the first ``--forgetting-samples`` test images (11 extra
evaluations per round otherwise dominate the CPU time).

Reported, mean +- std over seeds: final accuracy, best accuracy, and the first round reaching
FedAvg's final accuracy of the same seed (paper Table 2: rounds to target); the forgetting degree
(Eq. 1) averaged over rounds and clients per class role (missing / non-dominant / dominant).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from common import mean_std, parser
from fedskew.config import load_config
from fedskew.engine.runner import run

METHODS = {"fedavg": [], "fedntd": [], "fedka": [], "fedka-b01": ["method.ka_beta=0.1"]}
ROLES = ("missing", "non_dominant", "dominant")




def main():
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--subsample", type=float, default=0.1)
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--test-subsample", type=float, default=1.0, help="stratified share of the global test set kept")
    p.add_argument("--forgetting-samples", type=int, default=2000,
                   help="forgetting degree on the first n (kept) global test samples")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="fedka_fmnist_"))
    common = ["dataset=fmnist", f"dataset.root={args.data}", f"dataset.train_subsample={args.subsample}",
              f"dataset.test_subsample={args.test_subsample}",
              "model=tcnn", "partition=dirichlet", "partition.alpha=0.1", "partition.num_clients=10",
              "partition.local_test_fraction=0", "clients_per_round=10", f"rounds={args.rounds}",
              f"local_epochs={args.epochs}", "batch_size=128", "lr=0.01", "momentum=0.9", "weight_decay=1e-5",
              "executor=vectorized", "final_personalization=false", "forgetting_stats=true",
              f"forgetting_test_samples={args.forgetting_samples}"]
    print("settings:", " ".join(common), flush=True)
    rows = []
    for method in args.methods:
        for seed in args.seeds:
            t0 = time.perf_counter()
            res = run(load_config(None, common + [f"method={method}", *METHODS[method], f"seed={seed}"]),
                      out / f"{method}-s{seed}")
            accs = [h["global/test_acc"] for h in res.history]
            forgetting = {
                role: [h[f"forgetting/{role}"] for h in res.history if h.get(f"forgetting/{role}") is not None]
                for role in ROLES
            }
            rows.append({"method": method, "seed": seed, "accs": accs,
                         "forgetting": {r: (sum(v) / len(v) if v else None) for r, v in forgetting.items()}})
            print(
                f"{method} seed {seed}: final {100 * accs[-1]:.2f} best {100 * max(accs):.2f} forgetting "
                + " ".join(
                    f"{r} {rows[-1]['forgetting'][r]:.3f}" for r in ROLES if rows[-1]["forgetting"][r] is not None
                )
                + f" ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    (out / "results.json").write_text(json.dumps(rows, indent=2))

    def to_target(r):
        base = next((b for b in rows if b["method"] == "fedavg" and b["seed"] == r["seed"]), None)
        if base is None:
            return None
        hit = [t for t, a in enumerate(r["accs"]) if a >= base["accs"][-1]]
        return hit[0] + 1 if hit else None

    print("\n| method | final acc (%) | best acc (%) | rounds to FedAvg's final acc | reached | "
          "forgetting: missing | non-dominant | dominant |")
    print("|---|---|---|---|---|---|---|---|")
    for method in args.methods:
        rs = [r for r in rows if r["method"] == method]
        reach = [to_target(r) for r in rs]
        print(f"| {method} | {mean_std([r['accs'][-1] for r in rs])} | {mean_std([max(r['accs']) for r in rs])} "
              f"| {mean_std(reach, 1.0)} | {sum(x is not None for x in reach)}/{len(rs)} | "
              + " | ".join(mean_std([r["forgetting"][role] for r in rs], 1.0) for role in ROLES) + " |")
    print(f"\nrun directories and results.json in {out}")


if __name__ == "__main__":
    main()
