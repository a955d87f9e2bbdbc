"""FedAvg, FedAvg + fixed ETF head, ETF + global memory vectors and SCAFFOLD + ETF on real
Fashion-MNIST with the neural-collapse paper's label_count split ("FMNIST-100-k"), k = 2 and 5
(paper Tables 1-2 setting at CPU scale).

    python benchmarks/etf_fmnist.py --data DATA_DIR
    python benchmarks/etf_fmnist.py --data DATA_DIR --rounds 200 --samples-per-class 100

Setting: 100 clients, 10% per round, each client k classes with n samples of each (label_count),
SGD lr 0.03 momentum 0.9 weight decay 5e-4, batch 64, E = 2 (paper); MLP 784-200-200 (d = 200 >=
C), memory vectors from half of the rounds on with alpha 0.5 (paper grid {0.1, 0.5, 1.0}). CPU
scale: ``--rounds`` (paper: 1000) and ``--samples-per-class``. Reported, mean +- std over seeds:
global test accuracy (last round, mean of the last 10 rounds); a diverged run is counted, not hidden.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from common import mean_std, parser
from fedskew.config import load_config
from fedskew.engine.runner import run

VARIANTS = {
    "fedavg": ["method=fedavg"],
    "fedavg+etf": ["method=fedavg", "model.classifier=etf"],
    "etf+gmv": ["method=etf_gmv", "model.classifier=etf", "method.gmv_alpha=0.5"],
    "scaffold+etf": ["method=scaffold", "model.classifier=etf"],
}




def main():
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--samples-per-class", type=int, default=50)
    p.add_argument("--classes", type=int, nargs="+", default=[2, 5])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="etf_fmnist_"))
    common = ["dataset=fmnist", f"dataset.root={args.data}", "model=mlp", "partition=label_count",
              "partition.num_clients=100", f"partition.samples_per_class={args.samples_per_class}",
              "partition.local_test_fraction=0", "clients_per_round=10", f"rounds={args.rounds}",
              "local_epochs=2", "batch_size=64", "lr=0.03", "momentum=0.9", "weight_decay=5e-4",
              "executor=vectorized", "final_personalization=false"]
    print("settings:", " ".join(common), flush=True)
    rows = []
    for k in args.classes:
        for name in args.variants:
            for seed in args.seeds:
                t0 = time.perf_counter()
                cfg = load_config(None, common + [f"partition.classes_per_client={k}", *VARIANTS[name], f"seed={seed}"])
                try:
                    res = run(cfg, out / f"k{k}-{name}-s{seed}")
                except FloatingPointError as err:
                    rows.append({"k": k, "variant": name, "seed": seed, "diverged": str(err)})
                    print(f"k={k} {name} seed {seed}: diverged ({err})", flush=True)
                    continue
                s = res.summary
                rows.append({"k": k, "variant": name, "seed": seed, "last": s["global/test_acc"],
                             "last10": s["global/test_acc_mean_last10"]})
                print(
                    f"k={k} {name} seed {seed}: last {100 * s['global/test_acc']:.2f} "
                    f"last10 {100 * s['global/test_acc_mean_last10']:.2f} ({time.perf_counter() - t0:.0f}s)",
                    flush=True,
                )
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    print("\n| split | variant | last round (%) | mean of last 10 (%) | diverged |")
    print("|---|---|---|---|---|")
    for k in args.classes:
        for name in args.variants:
            rs = [r for r in rows if r["k"] == k and r["variant"] == name]
            ok = [r for r in rs if "diverged" not in r]
            print(f"| FMNIST-100-{k} (n={args.samples_per_class}) | {name} | {mean_std([r['last'] for r in ok])} "
                  f"| {mean_std([r['last10'] for r in ok])} | {len(rs) - len(ok)}/{len(rs)} |")
    print(f"\nrun directories and results.json in {out}")


if __name__ == "__main__":
    main()
