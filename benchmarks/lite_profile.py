"""Where a lite label-skew run's time goes, method by method (issue 55).

One run of each method as the lite suite runs it (Fashion-MNIST, its Dir0.1 setting, seed 0, the
method's first trial: its defaults at the suite's lr), warm (the data set decoded and the modules
imported by a first FedAvg run), in ``--procs`` processes side by side with one torch thread each
(as ``fedskew bench --jobs 2`` runs them). Per method: wall seconds of the run and its parts, the
local training of the rounds (``train``), the global evaluation (``eval``), the final local pass of
every client (``final``), checkpoints (``ckpt``), set-up (``init``) and the rest (``other``: the
server's own work, run files). The last lines add the suite's estimate: each method's run x its 35
runs (7 settings x 5 runs), over ``--procs`` jobs; settings differ in cost (C-20-2's clients hold
half the data), so the suite's measured time is the one to trust.

    OMP_NUM_THREADS=1 python benchmarks/lite_profile.py --data DATA_DIR [--methods fedavg,fedfed] [--procs 2]
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import tempfile
import time
import warnings


def _profile(names: list[str], data: str, queue) -> None:
    import torch

    torch.set_num_threads(1)
    from fedskew.config import InertOptionWarning
    from fedskew.engine import runner
    from fedskew.experiments import bench
    from fedskew.experiments.pool import execute_run
    from fedskew.experiments.spec import load_spec, plan

    warnings.simplefilter("ignore", InertOptionWarning)
    parts = collections.Counter()

    def timed(name, f):
        def wrapped(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                parts[name] += time.perf_counter() - t
        return wrapped

    runner.Experiment._train = timed("train", runner.Experiment._train)
    runner.Experiment._final_personalization = timed("final", runner.Experiment._final_personalization)
    runner.global_metrics = timed("eval", runner.global_metrics)
    runner.Experiment._checkpoint = timed("ckpt", runner.Experiment._checkpoint)
    runner.Experiment.__init__ = timed("init", runner.Experiment.__init__)

    def first_run(method: str) -> dict:
        spec = load_spec(bench.sweeps("label-skew", "lite", data, [method])["label-skew-fmnist"])
        return next(r for r in plan(spec) if r["partition"] == "Dir0.1")["config"]

    folder = tempfile.mkdtemp(prefix="fedskew-lite-profile-")
    execute_run(first_run("fedavg"), f"{folder}/warm-up")
    for name in names:
        parts.clear()
        t = time.perf_counter()
        execute_run(first_run(name), f"{folder}/{name}")
        total = time.perf_counter() - t
        queue.put({"method": name, "total": total, **parts, "other": total - sum(parts.values())})
    queue.put(None)


def main() -> None:
    from fedskew.algorithms import registered

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="folder holding fashion-mnist/")
    ap.add_argument("--methods", default=None, help="comma-separated (default: every registered method)")
    ap.add_argument("--procs", type=int, default=2)
    args = ap.parse_args()
    names = args.methods.split(",") if args.methods else sorted(registered())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_profile, args=(names[i::args.procs], args.data, queue)) for i in range(args.procs)]
    for p in procs:
        p.start()
    rows, open_procs = [], len(procs)
    while open_procs:
        row = queue.get()
        if row is None:
            open_procs -= 1
            continue
        rows.append(row)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    for p in procs:
        p.join()
    keys = ("train", "eval", "final", "ckpt", "init", "other")
    total = sum(r["total"] for r in rows)
    print(f"\n{len(rows)} methods, one lite Dir0.1 run each, {args.procs} processes: {total:.1f} s of runs")
    for k in keys:
        part = sum(r.get(k, 0.0) for r in rows)
        print(f"  {k:6s} {part:7.1f} s  {100 * part / total:5.1f} %")
    print(
        "slowest: "
        + ", ".join(f"{r['method']} {r['total']:.1f} s" for r in sorted(rows, key=lambda r: -r["total"])[:8])
    )
    print(f"suite estimate: {total:.1f} s x 35 runs / {args.procs} jobs = {total * 35 / args.procs / 60:.0f} min")


if __name__ == "__main__":
    main()
