"""The compiled stacked step (``compile=on``) vs the eager one (issue 53, item 2), side by side.

One process, interleaved: a run with ``compile=off``, then ``compile=on`` (its first run pays the
compilation of every step shape), then both again (the compiled one warm: torch's caches kept in
the process, as in a sweep's worker). Whole runs are timed; the ratios eager / compiled are
printed beside, and the global models compared (max |difference|). The setting is the lite
label-skew suite's (MLP 200-200 on Fashion-MNIST, 10 of 20 clients a round, 20 rounds of E = 2,
B = 64; ``--rounds`` shortens it), or README's digits default without ``--data``.

    OMP_NUM_THREADS=1 python benchmarks/compile_speed.py --data DATA_DIR   # CPU
    python benchmarks/compile_speed.py --device cuda --data DIR                  # on a GPU
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from fedskew.config import load_config
from fedskew.engine.runner import run


def keys(args) -> list[str]:
    common = [f"device={args.device}", "executor=vectorized", f"rounds={args.rounds}", "final_personalization=false"]
    if not args.data:
        return common
    return common + ["dataset=fmnist", f"dataset.root={args.data}", "dataset.train_subsample=0.1",
                     "dataset.test_subsample=0.2", "model=mlp", "model.hidden=[200,200]", "partition=dirichlet",
                     "partition.alpha=0.1", "partition.num_clients=20", "clients_per_round=10", "local_epochs=2",
                     "batch_size=64", "lr=0.01", "momentum=0.9"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data", help="folder holding fashion-mnist/ (default: README's digits setting)")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    times: dict[str, list[float]] = {"off": [], "on": []}
    states = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(2):
            for mode in ("off", "on"):
                t = time.perf_counter()
                res = run(load_config(None, keys(args) + [f"compile={mode}"]), Path(tmp) / f"{mode}{rep}")
                times[mode].append(time.perf_counter() - t)
                states[mode] = res.global_state
                print(f"compile={mode}, run {rep + 1}: {times[mode][-1]:.2f} s", flush=True)  # (what a cut step keeps)
    diff = max((states["off"][k] - v).abs().max().item() for k, v in states["on"].items() if v.is_floating_point())
    where = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu, 1 torch thread"
    print(f"compile_speed ({where}, torch {torch.__version__}, {'lite label-skew MLP' if args.data else 'digits'}, "
          f"{args.rounds} rounds): eager {times['off'][0]:.2f} s / {times['off'][1]:.2f} s; compiled, first run "
          f"(compiling) {times['on'][0]:.2f} s, warm {times['on'][1]:.2f} s; eager / compiled warm "
          f"{times['off'][1] / times['on'][1]:.2f} x, with the compilation {times['off'][0] / times['on'][0]:.2f} x; "
          f"models differ by {diff:.1e}")


if __name__ == "__main__":
    main()
