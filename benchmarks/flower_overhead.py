"""Per-round time of the same FedAvg work on fedskew's local executor and on Flower, side by side
in one script (machines here are noisy: compare the ratios, not absolute times between runs).

(a) ``fedskew run`` (sequential executor, one process); (b) Flower's simulation runtime (Ray);
(c) a real deployment on 127.0.0.1: a SuperLink and one SuperNode per client, each a separate
process, ``flwr run`` of the app fedskew writes, in three settings:
  c1 Flower defaults + the in-process ClientApp (every message starts a ``flwr-clientapp``
     process that imports torch and rebuilds data and model);
  c2 the torch-free ClientApp with a resident per-node worker (fedskew's default);
  c3 c2 + ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.05`` (SuperExec polls for tasks every 50 ms
     instead of 1 s).
The server side always pulls replies every 50 ms (Flower's ``send_and_receive`` waits 3 s between
pulls). Reported: the median of ``time/round_s`` over rounds 2..R (round 1 includes start-up).

    OMP_NUM_THREADS=1 python benchmarks/flower_overhead.py --rounds 6 --clients 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from fedskew.config import load_config
from fedskew.engine.runner import run


def median_round(run_dir: Path) -> float:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median(r["time/round_s"] for r in recs[1:])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--no-simulation", action="store_true")
    args = p.parse_args()
    from fedskew.flower.app import simulate
    from fedskew.flower.federation import LocalFederation

    cfg = load_config(None, [f"partition.num_clients={args.clients}", f"clients_per_round={args.clients}",
                             f"partition.classes_per_client={max(1, -(-10 // args.clients))}",
                             f"rounds={args.rounds}", "final_personalization=false"])
    out = Path(tempfile.mkdtemp(prefix="flower_overhead_"))
    times = {}
    run(cfg, out / "local")
    times["a  fedskew run (sequential)"] = median_round(out / "local")
    if not args.no_simulation:
        simulate(cfg, out / "sim")
        times["b  Flower simulation runtime"] = median_round(out / "sim")
    for label, client, poll in (("c1 deployment, Flower defaults, in-process ClientApp", "direct", None),
                                ("c2 deployment, resident worker", "worker", None),
                                ("c3 deployment, resident worker + SuperExec poll 50 ms", "worker", 0.05)):
        t0 = time.perf_counter()
        with LocalFederation(args.clients, out / f"fed-{client}-{poll}", poll_interval=poll) as fed:
            proc = fed.run(cfg, out / f"dep-{client}-{poll}", timeout=300, client=client)
        if proc.returncode != 0 or not (out / f"dep-{client}-{poll}" / "summary.json").is_file():
            print(f"{label}: failed, see {out}")
            continue
        times[label] = median_round(out / f"dep-{client}-{poll}")
        print(f"{label}: {times[label]:.2f} s/round ({time.perf_counter() - t0:.0f} s in all)", flush=True)
    base = times["a  fedskew run (sequential)"]
    print(f"\nFedAvg, digits, {args.clients} clients all selected, {args.rounds} rounds, E = 5, MLP 200-200")
    print("| engine | s / round (median, rounds 2..R) | overhead vs (a) (s) | ratio to (a) |")
    print("|---|---|---|---|")
    for label, t in times.items():
        print(f"| {label} | {t:.3f} | {t - base:+.2f} | {t / base:.1f}x |")
    print(f"\nrun directories in {out}")


if __name__ == "__main__":
    main()
