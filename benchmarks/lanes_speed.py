"""Runs as lanes: R runs of one setting trained as one pack vs the same runs one after another.

Each repetition times, in one process and interleaved (alone, packed, alone, packed, ...), the R
runs (seeds 0..R-1, learning rates alternating lr and 1.5 lr) on the vectorised executor one after
another, then the same R runs as one :class:`~fedskew.engine.lanes.Pack`; with ``--sequential``
also one after another on the sequential executor. Whole runs are timed (set-up, every round,
evaluation, checkpoints), the median of the repetitions is reported, and the ratio alone / packed
is printed beside. The global models are compared too (packed vs alone, max |difference|).

    python benchmarks/lanes_speed.py                                    # digits P20C3 MLP 200-200, 8 runs
    python benchmarks/lanes_speed.py --setting simplecnn --data DIR     # NIID-Bench's FMNIST SimpleCNN
    python benchmarks/lanes_speed.py --device cuda --runs 20 --rounds 10
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedskew.config import load_config
from fedskew.engine.lanes import Pack
from fedskew.engine.runner import Experiment

SETTINGS = {
    # README's default setting (digits, P20C3, MLP 200-200, 10 of 20 clients a round, E = 5, B = 16)
    "digits": ["final_personalization=false"],
    # NIID-Bench's FMNIST protocol: 10 clients #C=2, all every round, SimpleCNN, E = 10, B = 64
    "simplecnn": ["dataset=fmnist", "partition=label_k", "partition.classes_per_client=2",
                  "partition.num_clients=10", "clients_per_round=10", "model=simplecnn", "local_epochs=10",
                  "batch_size=64", "final_personalization=false", "dataset.train_subsample=0.2"],
}


def configs(args) -> list:
    base = SETTINGS[args.setting] + [f"rounds={args.rounds}", "executor=vectorized", f"device={args.device}",
                                     f"checkpoint_every={args.rounds}"]
    if args.data:
        base.append(f"dataset.root={args.data}")
    base += args.extra
    lr = load_config(None, base).lr
    return [load_config(None, base + [f"seed={i}", f"lr={lr * (1.5 if i % 2 else 1.0)!r}"]) for i in range(args.runs)]


def timed(fn) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="digits")
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--data", help="folder with Fashion-MNIST (simplecnn)")
    parser.add_argument("--sequential", action="store_true", help="also time the runs on the sequential executor")
    parser.add_argument("--json", help="also write the figures to this JSON file (for docs/performance.md)")
    parser.add_argument("extra", nargs="*", help="more key=value overrides")
    args = parser.parse_args()
    cfgs = configs(args)
    tmp = Path(tempfile.mkdtemp())
    times = {"alone": [], "packed": [], "sequential": []}
    for rep in range(args.repeats):
        t, alone = timed(lambda rep=rep: [Experiment(c, tmp / f"alone{rep}-{i}").run() for i, c in enumerate(cfgs)])
        times["alone"].append(t)
        pack = Pack()
        t, packed = timed(lambda pack=pack, rep=rep: pack.run([Experiment(c, tmp / f"packed{rep}-{i}", pack=pack)
                                            for i, c in enumerate(cfgs)]))
        times["packed"].append(t)
        if args.sequential:
            t, _ = timed(
                lambda rep=rep: [
                    Experiment(c.model_copy(update={"executor": "sequential"}), tmp / f"seq{rep}-{i}").run()
                    for i, c in enumerate(cfgs)
                ]
            )
            times["sequential"].append(t)
    diff = max((a.global_state[k] - b.global_state[k]).abs().max().item()
               for a, b in zip(alone, packed) for k in a.global_state)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    device = (
        torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    )
    print(f"setting {args.setting}: {args.runs} runs x {args.rounds} rounds on {device}, torch {torch.__version__}; "
          f"median of {args.repeats}")
    for k, v in med.items():
        print(f"  {k:>10}: {v:7.2f} s   ({med['alone'] / v:5.2f} x alone)")
    print(f"  packed vs alone: max |global difference| {diff:.2e}; pack made {pack.calls} stacked calls "
          f"(merged: {pack.merge})")
    if args.json:
        from common import write_result

        write_result(args.json, "lanes", "Runs as lanes: a sweep's runs trained alone and packed into one program",
                     ["how", "seconds", "x alone"], [[k, v, med["alone"] / v] for k, v in med.items()],
                     f"setting {args.setting}: {args.runs} runs x {args.rounds} rounds, the median of {args.repeats}; "
                     f"packed vs alone: max |global difference| {diff:.2e}.", args.device)


if __name__ == "__main__":
    main()
