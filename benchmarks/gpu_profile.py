"""Where a paper-scale MAP round's time goes: kernels against the host, launches per local step,
memory copies, host syncs, idle gaps, and the round's FLOPs against the card's peak.

The setting is MAP's Table I row as ``engine_speed.py --paper map`` times it (Fashion-MNIST, MLPNet
784-1024-1024-128, 100 clients, 20 a round, E = 5, B = 64, MAP itself) on one executor. One round
warms up (allocations, the padding check); ``--rounds`` rounds are timed without the profiler (the
wall time the fraction of peak is taken against); then ``--profiled`` rounds run under
``torch.profiler`` (CPU and, on CUDA, the device's activity) and once more under
``torch.utils.flop_counter.FlopCounterMode``, which counts the matrix products' floating-point
operations of forward and backward alike (what the kernels compute: the vectorised executor's padded
rows included, evaluation included). What it prints:

- the round's wall time, and the share of it in which some kernel ran on the device (the union
  of the kernels' intervals over the profiled rounds' span); the rest is the host's (Python,
  dispatch, launches) or waiting;
- kernels and runtime launches per round, per client step and per stacked step (a client step is
  one mini-batch of one client; the vectorised executor runs the selected clients' steps side by
  side, one stacked step per batch position);
- memory copies (count and bytes, by direction) and the calls that make the host wait for the
  device (synchronize, blocking copies);
- the idle gaps between kernels: how many, their sum, the longest;
- the ten kernels and the ten host operators that take the most time;
- the round's FLOPs, the achieved rate, and the fraction of the card's FP32 peak (``--peak-tflops``,
  or the datasheet figure of a known card).

    python benchmarks/gpu_profile.py --device cuda --data DIR                     # on a card
    python benchmarks/gpu_profile.py --device cpu --data DIR --config partition.num_clients=10 \\
        clients_per_round=2 local_epochs=1 --peak-tflops 1                         # the mechanism, on a CPU
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_speed import PAPER, build, sync  # noqa: E402
from fedskew.engine.protocol import batch_schedule  # noqa: E402
from fedskew.streams import sample_clients  # noqa: E402

# Dense FP32 (non-tensor-core) peaks from NVIDIA's datasheets, TFLOP/s; the first name contained in the
# device's name is taken (so "H100 PCIe" before "H100").
PEAK_FP32_TFLOPS = {"H200": 67.0, "H100 PCIe": 51.0, "H100 NVL": 60.0, "H100": 67.0, "A100": 19.5, "L40S": 91.6,
                    "L4": 30.3, "A10": 31.2}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ", "cudaMemcpy")


def peak_tflops(device: torch.device, given: float | None) -> tuple[float | None, str]:
    if given is not None:
        return given, "given with --peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_FP32_TFLOPS.items():
            if key in name:
                return value, f"{name}'s datasheet FP32 figure"
        return None, f"{name} is not in the table: give --peak-tflops"
    return None, "a CPU has no table figure: give --peak-tflops"


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals, as sorted disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def trace_summary(trace: dict, rounds: int) -> dict:
    """Figures of a Chrome trace that ``torch.profiler`` exported (times in microseconds)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    launches = sum("LaunchKernel" in e["name"] for e in runtime)
    out: dict = {"kernels": len(kernels) / rounds, "launches": launches / rounds}
    busy = merged([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    if busy:
        span = busy[-1][1] - busy[0][0]
        gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:])]
        out |= {"kernel_us": sum(b - a for a, b in busy) / rounds, "span_us": span,
                "gaps": len(gaps) / rounds, "gap_us": sum(gaps) / rounds, "gaps_over_100us": sum(g > 100 for g in gaps)
                / rounds, "longest_gap_us": max(gaps, default=0.0)}
    by_dir: Counter = Counter()
    bytes_by_dir: Counter = Counter()
    for e in copies:
        kind = e["name"].split("(")[0].strip()  # "Memcpy HtoD (Pageable -> Device)" -> "Memcpy HtoD"
        by_dir[kind] += 1
        bytes_by_dir[kind] += int(e.get("args", {}).get("bytes", 0))
    out["copies"] = {k: (n / rounds, bytes_by_dir[k] / rounds) for k, n in by_dir.items()}
    out["syncs"] = sum(any(e["name"].startswith(s) for s in SYNC_CALLS) for e in runtime) / rounds
    top_k: Counter = Counter()
    for e in kernels:
        top_k[e["name"][:90]] += e["dur"]
    out["top_kernels"] = [(name, us / rounds) for name, us in top_k.most_common(10)]
    return out | {"ops": len(ops) / rounds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--data", help="a folder holding Fashion-MNIST (as fedskew's dataset.root reads it)")
    p.add_argument("--executor", default="vectorized", choices=["vectorized", "sequential"])
    p.add_argument("--rounds", type=int, default=3, help="rounds timed without the profiler (default 3)")
    p.add_argument("--profiled", type=int, default=2, help="rounds under the profiler (default 2)")
    p.add_argument("--peak-tflops", type=float, help="the card's FP32 peak (default: the datasheet table)")
    p.add_argument("--config", nargs="*", default=[], help="more config keys (KEY=VALUE), after the paper's")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_profile: torch sees no CUDA device here; --device cpu profiles the host alone.", file=sys.stderr)
        return 2
    overrides = [*PAPER["map"], "final_personalization=false", f"device={args.device}",
                 *([f"dataset.root={args.data}"] if args.data else []), *args.config]
    engine = build("padded" if args.executor == "vectorized" else "sequential", overrides)
    exp, cfg = engine.exp, engine.exp.cfg
    n = exp.fed.num_clients
    per_round = min(cfg.clients_per_round if isinstance(cfg.clients_per_round, int) else n, n)
    total = 1 + args.rounds + args.profiled + 1  # warm-up, timed, profiled, counted
    picks = [sample_clients(cfg.seed, t, n, per_round) for t in range(total)]
    settings = exp.executor.settings
    steps = [[len(batch_schedule(settings, t, k, len(exp.fed.train_idx[k]))) for k in picks[t]] for t in range(total)]
    params = sum(v.numel() for v in exp.model.parameters())
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
          f", {torch.get_num_threads()} threads; MAP's Table I setting on the {args.executor} executor: "
          f"{n} clients, {per_round} a round, E = {cfg.local_epochs}, B = {cfg.batch_size}, model {cfg.model.name} "
          f"({params / 1e6:.2f} M parameters), method {cfg.method.name}", flush=True)

    t = 0
    t0 = time.perf_counter()
    engine.round(t, picks[t], cfg.lr)
    print(f"warm-up round: {time.perf_counter() - t0:.2f} s", flush=True)
    walls = []
    for t in range(1, 1 + args.rounds):
        t0 = time.perf_counter()
        engine.round(t, picks[t], cfg.lr)
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    first = 1 + args.rounds
    prof_rounds = range(first, first + args.profiled)
    client_steps = statistics.mean(sum(steps[r]) for r in prof_rounds)
    stacked_steps = statistics.mean(max(steps[r]) for r in prof_rounds)
    print(f"round wall time (median of {args.rounds}, no profiler): {wall:.3f} s; {client_steps:.0f} client steps "
          f"a round, {stacked_steps:.0f} stacked steps (the longest client's)", flush=True)

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for r in prof_rounds:
            engine.round(r, picks[r], cfg.lr)
        sync(device)
    profiled_wall = (time.perf_counter() - t0) / args.profiled
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(str(Path(tmp) / "trace.json"))
        trace = json.loads((Path(tmp) / "trace.json").read_text())
    s = trace_summary(trace, args.profiled)
    print(f"\nunder the profiler: {profiled_wall:.3f} s a round (the profiler's own cost: "
          f"{profiled_wall / wall:.2f} x)")
    if "kernel_us" in s:
        print(f"device busy (some kernel running): {s['kernel_us'] / 1e6:.3f} s a round = "
              f"{s['kernel_us'] / 1e6 / profiled_wall:.1%} of the profiled round; idle gaps {s['gaps']:.0f} a round, "
              f"{s['gap_us'] / 1e6:.3f} s in all, {s['gaps_over_100us']:.0f} over 100 us, the longest "
              f"{s['longest_gap_us'] / 1e3:.1f} ms")
        print(f"kernels {s['kernels']:.0f} a round = {s['kernels'] / client_steps:.1f} a client step = "
              f"{s['kernels'] / stacked_steps:.1f} a stacked step; launches {s['launches']:.0f} a round")
        for kind, (count, nbytes) in sorted(s["copies"].items()):
            print(f"{kind}: {count:.0f} a round, {nbytes / 2**20:.1f} MiB")
        print(f"calls that wait for the device (synchronize, blocking copies): {s['syncs']:.0f} a round")
        print("top kernels (time a round):")
        for name, us in s["top_kernels"]:
            print(f"  {us / 1e3:9.2f} ms  {name}")
    print(f"host operators recorded: {s['ops']:.0f} a round; top host operators by self time:")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60)
    print("\n".join("  " + line for line in table.splitlines()))

    from torch.utils.flop_counter import FlopCounterMode

    r = first + args.profiled
    counter = FlopCounterMode(display=False)
    with counter:
        engine.round(r, picks[r], cfg.lr)
    # per client step, times a timed round's client steps (rounds differ in their clients' sizes)
    flops = counter.get_total_flops() / max(sum(steps[r]), 1) * statistics.mean(sum(steps[t])
                                                                                for t in range(1, 1 + args.rounds))
    rate = flops / wall / 1e12
    peak, where = peak_tflops(device, args.peak_tflops)
    print(f"\nFLOPs a round (torch.utils.flop_counter, matrix products, forward and backward): {flops / 1e9:.6g} "
          f"GFLOP; achieved {rate:.3g} TFLOP/s at the unprofiled wall time")
    if peak:
        print(f"fraction of the FP32 peak ({peak:g} TFLOP/s, {where}): {rate / peak:.2%}")
    else:
        print(f"fraction of the FP32 peak: not computed ({where})")
    if not math.isfinite(rate) or flops <= 0:
        print("gpu_profile: no floating-point operations were counted", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
