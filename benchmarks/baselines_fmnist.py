"""Every generic-FL baseline vs FedAvg on real Fashion-MNIST, pcdd P10C2, several seeds.

    python benchmarks/baselines_fmnist.py --data DATA_DIR
    python benchmarks/baselines_fmnist.py --data DATA_DIR --methods fedavg scaffold --rounds 50

All methods share one setting per seed (partition, client schedule, batch order); each uses its
documented default options (docs/methods.md) unless given in METHOD_ARGS. Reported: last-round
``global/test_acc`` and the mean of the last 5 evaluations, mean +- std over seeds, and the gain
of the last-5 mean over FedAvg in points.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from common import parser
from fedskew.config import load_config
from fedskew.engine.runner import run

METHODS = ["fedavg", "fedprox", "scaffold", "scaffold-sgd", "scaffold-steps", "scaffold-loss", "feddyn", "feddc",
           "feddc-paper", "fednova", "fedavgm", "fedadam", "fedyogi", "fedaws", "moon", "fedmmd", "fedproc", "fedmr",
           # issue 22 (FedBN is FedAvg on this BN-free SimpleCNN; FedPer, LG-FedAvg, FedFOMO have no global model)
           "feddecorr", "ccvr", "fednh", "feddf", "fedala", "apfl", "fedetf", "fedgen", "flda"]
# A label is a method name (its defaults) or "<method>-<variant>"; its options follow the shared settings.
METHOD_ARGS = {
    "scaffold-sgd": ["momentum=0"],  # the paper's plain SGD
    "scaffold-steps": ["method.control_steps=steps"],  # control divided by the raw step count (paper form)
    "scaffold-loss": ["method.correction=loss", "method.control_steps=steps"],  # fedskew's default before issue 17
    "feddc-paper": ["method.aggregation=paper", "method.by_data_size=false", "method.control_steps=steps"],
    "moon": ["method.mu=1.0"],
    "feddf-steps100": ["method.distill_steps=100"],  # a fifth of the default server distillation
    "fedgen-uniform": ["method.noise=uniform"],  # the official code's torch.rand noise
    "fedgen-beta10": ["method.generative_beta=10"],  # the official MNIST latent weight
}


def main():
    p = parser(__doc__)
    p.add_argument("--methods", nargs="+", default=METHODS)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--subsample", type=float, default=0.1)
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="baselines_fmnist_"))
    common = ["dataset=fmnist", f"dataset.root={args.data}", f"dataset.train_subsample={args.subsample}",
              "model=simplecnn", "partition=pcdd", "partition.num_clients=10", "partition.classes_per_client=2",
              "partition.local_test_fraction=0", "clients_per_round=10", f"rounds={args.rounds}",
              f"local_epochs={args.epochs}", "batch_size=64", "lr=0.01", "momentum=0.9", "weight_decay=1e-5",
              "executor=vectorized", "final_personalization=false", "eval_every=1"]
    print("settings:", " ".join(common), flush=True)
    rows = []
    for method in args.methods:
        for seed in args.seeds:
            extra = METHOD_ARGS.get(method, [])
            t0 = time.perf_counter()
            cfg = load_config(None, common + [f"method={method.split('-')[0]}", *extra, f"seed={seed}"])
            try:
                res = run(cfg, out / f"{method}-s{seed}")
            except FloatingPointError as err:  # reported as diverged, not dropped
                rows.append({"method": method, "args": extra, "seed": seed, "diverged": str(err)})
                print(f"{method} seed {seed}: diverged ({err})", flush=True)
                continue
            accs = [h["global/test_acc"] for h in res.history if "global/test_acc" in h]
            rows.append({"method": method, "args": extra, "seed": seed, "last": accs[-1],
                         "last5": sum(accs[-5:]) / len(accs[-5:]), "extra_pct": res.summary["comm/extra_pct"]})
            print(f"{method} seed {seed}: last {100 * accs[-1]:.2f} last5 {100 * rows[-1]['last5']:.2f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2))

    def stats(method, key):
        vals = [r[key] for r in rows if r["method"] == method and "diverged" not in r]
        if not vals:
            return float("nan"), float("nan")
        return statistics.mean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)

    base = stats("fedavg", "last5")[0] if any(r["method"] == "fedavg" for r in rows) else None
    print(
        "\n| method | options | last round (%) | mean of last 5 (%) | vs FedAvg (points) | extra comm (%) | diverged |"
    )
    print("|---|---|---|---|---|---|---|")
    for method in args.methods:
        (lm, ls), (fm, fs) = stats(method, "last"), stats(method, "last5")
        gain = f"{100 * (fm - base):+.2f}" if base is not None else "-"
        extra = next((f"{r['extra_pct']:.1f}" for r in rows if r["method"] == method and "diverged" not in r), "-")
        diverged = sum("diverged" in r for r in rows if r["method"] == method)
        print(f"| {method} | {' '.join(METHOD_ARGS.get(method, [])) or 'defaults'} | {100 * lm:.2f} +- {100 * ls:.2f} "
              f"| {100 * fm:.2f} +- {100 * fs:.2f} | {gain} | {extra} | {diverged}/{len(args.seeds)} |")
    print(f"\nrun directories and results.json in {out}")


if __name__ == "__main__":
    main()
