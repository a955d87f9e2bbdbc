"""A CPU round against its arithmetic: where a round's time goes, on each executor.

The task of the frameworks comparison: Fashion-MNIST, 20 clients with 2 classes each (pcdd), MLP
784-200-200-10, SGD lr 0.01 without momentum, batch 64, 1 local epoch, all clients every round,
evaluation every round (each client's model on its own local test split before and after local
training, the global model on the official test set), one torch thread. Both executors' rounds are
interleaved (sequential, vectorised, sequential, ...) after one warm-up round each, so machine
noise hits both alike; each is timed whole (wall and CPU seconds) and in parts: the local
evaluation, the global test pass, and the rest (local training, aggregation).

The round's arithmetic: the matmul FLOPs of one training step and one evaluation forward, counted
by ``torch.utils.flop_counter`` on one batch, times the round's samples (elementwise work, memory
bound, is not counted: it is part of what the ratio measures). The machine's single-thread rate
is measured on the same matmuls (their shapes and layouts recorded from those passes and
replayed), so arithmetic seconds = FLOPs / rate, and CPU seconds / arithmetic seconds is how far
a round is from what its matmuls cost.

    python benchmarks/round_cost.py --data DIR --json benchmarks/results/round-cost-cpu.json
    python benchmarks/round_cost.py --data DIR --rounds 3 --clients 10   # quicker
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from common import hardware, parser, write_result
from fedskew.config import load_config
from fedskew.engine import runner as runner_module
from fedskew.engine.local import federated_state
from fedskew.engine.runner import Experiment
from fedskew.models.functional import call

EXECUTORS = ("sequential", "vectorized")
MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}


def task(args, executor: str) -> list[str]:
    return ["dataset=fmnist", f"dataset.root={args.data}", "model=mlp", "model.hidden=[200,200]", "partition=pcdd",
            f"partition.num_clients={args.clients}", "partition.classes_per_client=2",
            f"clients_per_round={args.clients}", f"rounds={args.rounds + 1}", "local_epochs=1", "batch_size=64",
            "lr=0.01", "momentum=0", "eval_every=1", "final_personalization=false", f"seed={args.seed}",
            f"executor={executor}"]


class Timed:
    """Wall and CPU seconds spent inside a wrapped function since the last ``take``."""

    def __init__(self, fn):
        self.fn, self.wall, self.cpu = fn, 0.0, 0.0

    def __call__(self, *a, **k):
        w, c = time.perf_counter(), time.process_time()
        try:
            return self.fn(*a, **k)
        finally:
            self.wall += time.perf_counter() - w
            self.cpu += time.process_time() - c

    def take(self) -> tuple[float, float]:
        out = (self.wall, self.cpu)
        self.wall = self.cpu = 0.0
        return out


def global_eval_timer() -> Timed:
    """The global test pass (``global_metrics`` as the runner calls it), timed from now on."""
    if not isinstance(runner_module.global_metrics, Timed):
        runner_module.global_metrics = Timed(runner_module.global_metrics)
    return runner_module.global_metrics


class Run:
    """One run (``overrides``), driven round by round, its evaluations timed apart."""

    def __init__(self, overrides: list[str], run_dir):
        self.global_eval = global_eval_timer()
        self.exp = Experiment(load_config(None, overrides), run_dir)
        ex = self.exp.executor
        self.local = Timed(ex.accuracies)
        ex.accuracies = self.local
        m = self.exp.method
        self.state = federated_state(self.exp.model)
        self.server = m.server_init(self.state, m.info)
        self.clients = runner_module.ClientStates()
        self.totals = {"up": 0, "down": 0, "up_model": 0, "down_model": 0}

    def round(self, t: int) -> dict:
        self.local.take(), self.global_eval.take()
        w, c = time.perf_counter(), time.process_time()
        record = self.exp._round(t, self.state, self.server, self.clients, self.totals)
        wall, cpu = time.perf_counter() - w, time.process_time() - c
        self.state, self.server = record.pop("_global"), record.pop("_server")
        (lw, lc), (gw, gc) = self.local.take(), self.global_eval.take()
        return {"wall": wall, "cpu": cpu, "local_eval_wall": lw, "local_eval_cpu": lc, "global_eval_wall": gw,
                "global_eval_cpu": gc, "acc": record["global/test_acc"], "acc_after": record["personal/acc_after"]}


class Matmuls(TorchDispatchMode):
    """The matmuls a pass runs: (op, shapes and strides of its tensor arguments)."""

    def __init__(self):
        super().__init__()
        self.seen: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in MATMULS:
            self.seen.append((func, [(tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a
                                     for a in args]))
        return func(*args, **(kwargs or {}))


def passes(exp: Experiment, eval_rows: int):
    """(training step, evaluation forward) of the run's model on real samples: a batch of 64
    (forward, loss, backward) and ``eval_rows`` samples (eval mode, no gradient)."""
    model, x, y = exp.model, exp.executor.x, exp.executor.y
    state = {k: v.detach().clone().requires_grad_(v.is_floating_point())
             for k, v in federated_state(model).items()}

    def step():
        loss = F.cross_entropy(call(model, state, x[:64], features=False), y[:64])
        torch.autograd.grad(loss, [v for v in state.values() if v.requires_grad])

    def forward():
        model.eval()
        with torch.no_grad():
            call(model, state, x[:eval_rows], features=False)
        model.train()
    return step, forward


def flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def matmul_rate(fns, repeats: int = 30) -> float:
    """FLOP/s of the matmuls ``fns`` run, replayed alone on fresh tensors of the same shapes and
    strides (the median time of each over ``repeats``)."""
    ops = []
    for fn in fns:
        with Matmuls() as rec:
            fn()
        ops += rec.seen
    total_flops, total_s = 0, 0.0
    for func, spec in ops:
        args = [torch.empty_strided(s[0], s[1]).normal_() if isinstance(s, tuple) and isinstance(s[0], tuple) else s
                for s in spec]
        with FlopCounterMode(display=False) as counter:
            func(*args)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            func(*args)
            times.append(time.perf_counter() - t0)
        total_flops += counter.get_total_flops()
        total_s += statistics.median(times)
    return total_flops / total_s


def main():
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per executor (after one warm-up round)")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figure here (benchmarks/results/round-cost-cpu.json)")
    args = p.parse_args()
    torch.set_num_threads(1)
    import tempfile
    from pathlib import Path

    out = Path(args.out or tempfile.mkdtemp(prefix="round_cost_"))
    runs = {e: Run(task(args, e), out / e) for e in EXECUTORS}
    per: dict[str, list[dict]] = {e: [] for e in EXECUTORS}
    for t in range(args.rounds + 1):
        for e, r in runs.items():
            rec = r.round(t)
            if t:  # round 0 warms up (first calls, the padding check)
                per[e].append(rec)
            print(f"round {t} {e:10s} wall {rec['wall']:.3f} s  cpu {rec['cpu']:.3f} s  local eval "
                  f"{rec['local_eval_wall']:.3f} s  global eval {rec['global_eval_wall']:.3f} s", flush=True)
    for e in EXECUTORS[1:]:  # the executors train the same clients on the same batches: same accuracy
        a, b = per[EXECUTORS[0]][-1]["acc"], per[e][-1]["acc"]
        assert abs(a - b) < 2e-3, f"global test accuracy differs: {EXECUTORS[0]} {a}, {e} {b}"

    exp = runs["sequential"].exp
    fed = exp.fed
    train = sum(len(fed.train_idx[k]) for k in range(fed.num_clients))
    local_test = sum(len(fed.test_idx[k]) for k in range(fed.num_clients))
    global_test = len(exp.y_test)
    step, forward = passes(exp, 512)
    train_per_sample, eval_per_sample = flops(step) / 64, flops(forward) / 512
    round_flops = train * train_per_sample + (2 * local_test + global_test) * eval_per_sample
    rate = matmul_rate([step, forward])
    arithmetic_s = round_flops / rate
    med = {e: {k: statistics.median(r[k] for r in per[e]) for k in per[e][0]} for e in EXECUTORS}
    print(f"\ntraining samples {train}, local test {local_test} (scored twice), global test {global_test}")
    print(f"matmul FLOPs: {train_per_sample / 1e6:.3f} M per training sample, {eval_per_sample / 1e6:.3f} M per "
          f"evaluated sample; {round_flops / 1e9:.2f} GFLOP a round")
    print(f"single-thread matmul rate on those shapes: {rate / 1e9:.1f} GFLOP/s -> {arithmetic_s:.3f} s a round")
    rows = []
    for e in EXECUTORS:
        m = med[e]
        rest = m["cpu"] - m["local_eval_cpu"] - m["global_eval_cpu"]
        rows.append([e, m["wall"], m["cpu"], rest, m["local_eval_cpu"], m["global_eval_cpu"],
                     m["cpu"] / arithmetic_s])
        print(f"{e:10s} median of {args.rounds}: wall {m['wall']:.3f} s, cpu {m['cpu']:.3f} s (training and "
              f"aggregation {rest:.3f}, local evaluation {m['local_eval_cpu']:.3f}, global test "
              f"{m['global_eval_cpu']:.3f}); {m['cpu'] / arithmetic_s:.2f}x the arithmetic")
    seq, vec = med["sequential"], med["vectorized"]
    rows.append(["arithmetic (matmuls at the measured rate)", arithmetic_s, arithmetic_s, None, None, None, 1.0])
    rows.append(["ratio, sequential / vectorized", seq["wall"] / vec["wall"], seq["cpu"] / vec["cpu"], None, None,
                 None, None])
    print(f"sequential / vectorized: wall {seq['wall'] / vec['wall']:.2f}x, cpu {seq['cpu'] / vec['cpu']:.2f}x")
    if args.json:
        write_result(args.json, "round-cost", "A CPU round against its arithmetic",
                     ["executor", "wall s a round", "CPU s a round", "training and aggregation, CPU s",
                      "local evaluation, CPU s", "global test, CPU s", "CPU / arithmetic"], rows,
                     notes=f"Fashion-MNIST, pcdd {args.clients} clients x 2 classes, MLP 784-200-200-10, SGD lr 0.01, "
                           f"batch 64, 1 epoch, all clients, evaluation every round; median of {args.rounds} "
                           f"interleaved rounds after a warm-up, seed {args.seed}. Arithmetic: "
                           f"{round_flops / 1e9:.2f} GFLOP of matmuls a round ({train} training samples, "
                           f"{local_test} local test samples scored twice, {global_test} global) at "
                           f"{rate / 1e9:.1f} GFLOP/s, the single-thread rate measured on the same matmul shapes. "
                           f"Hardware: {hardware()}.")


if __name__ == "__main__":
    main()
