"""Scale-out overheads, measured side by side on this machine (docs/scaling.md).

    python benchmarks/scaling.py --data DATA_DIR

1. The same 12-run sweep (2 methods x 2 partitions x 3 seeds, digits) with ``--jobs 2`` and on Ray
   (a local instance started by the sweep, 1 CPU per run): wall time of each and the overhead per
   run, (Ray - jobs) / 12; both databases are checked equal (wall-clock metrics aside).
2. One 100-client round (Fashion-MNIST from --data, 10% of the training images, MLP 200-200, E = 1
   and 5, B = 16, every client selected) in one process (1 and 2 torch threads) and over 2 torchrun ranks
   (gloo, 1 thread each): the mean ``time/round_s`` and ``time/client_train_s`` of rounds 2..R (round
   1 includes warm-up) and the global accuracy, which must agree; and what moving the uploads to
   rank 0 costs (pickled objects vs fedskew's flat-tensor messages).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SWEEP = {"name": "scaling", "base": {"rounds": 10, "local_epochs": 2, "clients_per_round": 5,
                                     "model": {"name": "mlp", "hidden": [64]}},
         "methods": ["fedavg", "scaffold"],
         "partitions": {"P10C3": {"name": "pcdd", "num_clients": 10, "classes_per_client": 3},
                        "Dir": {"name": "dirichlet", "num_clients": 10, "alpha": 0.5}},
         "seeds": [0, 1, 2]}


def db_rows(folder: Path):
    db = sqlite3.connect(folder / "results.sqlite")
    def drop(d):
        return {k: v for k, v in json.loads(d).items() if not k.startswith("time/")}
    rows = ({r[0]: (r[1], drop(r[2])) for r in db.execute("SELECT run_id, status, summary FROM runs")},
            {(r[0], r[1]): drop(r[2]) for r in db.execute("SELECT run_id, round, metrics FROM rounds")})
    db.close()
    return rows


def sweep_overhead(out: Path) -> None:
    (out / "scaling.yaml").write_text(json.dumps(SWEEP))
    walls = {}
    for name, flags in (("jobs2", ["--jobs", "2"]), ("ray", ["--ray"])):
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "fedskew.cli", "sweep", str(out / "scaling.yaml"), "--out",
                               str(out / name), "--no-report", *flags], capture_output=True, text=True)
        walls[name] = time.perf_counter() - t0
        assert done.returncode == 0, done.stderr[-2000:]
        print(f"sweep {name}: {walls[name]:.1f} s for 12 runs", flush=True)
    same = db_rows(out / "jobs2") == db_rows(out / "ray")
    print("\n| 12-run sweep | wall (s) | per run (s) |\n|---|---|---|")
    for name, wall in walls.items():
        print(f"| {'--jobs 2' if name == 'jobs2' else '--ray (local instance, 1 CPU per run)'} | {wall:.1f} | "
              f"{wall / 12:.2f} |")
    print(f"\nRay overhead per run: {(walls['ray'] - walls['jobs2']) / 12:+.2f} s "
          f"(ratio {walls['ray'] / walls['jobs2']:.2f}); databases equal: {same}\n", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def round_time(out: Path, data: str, rounds: int, epochs: int) -> None:
    common = ["dataset=fmnist", f"dataset.root={os.path.abspath(data)}", "dataset.train_subsample=0.1",
              "model.hidden=[200,200]", "partition=pcdd", "partition.num_clients=100",
              "partition.classes_per_client=2", "clients_per_round=100", f"rounds={rounds}", f"local_epochs={epochs}",
              "batch_size=16", "final_personalization=false", f"out_dir={out}"]
    cases = [("1 process, 1 thread", {"OMP_NUM_THREADS": "1"}, 0),
             ("1 process, 2 threads", {"OMP_NUM_THREADS": "2"}, 0),
             ("2 torchrun ranks, 1 thread each", {"OMP_NUM_THREADS": "1"}, 2)]
    rows = []
    for i, (label, env, ranks) in enumerate(cases):
        cmd = [sys.executable, "-m", "fedskew.cli", "run", *common, f"run_name=e{epochs}-r{i}"]
        if ranks:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                   "--master_addr=127.0.0.1", f"--master_port={free_port()}", *cmd[1:], "distributed=true"]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
        assert done.returncode == 0, done.stderr[-2000:]
        recs = [json.loads(line) for line in (out / f"e{epochs}-r{i}" / "metrics.jsonl").read_text().splitlines()][1:]
        rows.append((label, sum(r["time/round_s"] for r in recs) / len(recs),
                     sum(r["time/client_train_s"] for r in recs) / len(recs), recs[-1]["global/test_acc"]))
        print(f"{label}: round {rows[-1][1]:.2f} s", flush=True)
    base = rows[0][1]
    print(
        f"\nE = {epochs}:\n\n| 100-client round | round (s) | client training (s) | vs 1 process, 1 thread "
        "| final global acc |"
    )
    print("|---|---|---|---|---|")
    for label, r, t, acc in rows:
        print(f"| {label} | {r:.2f} | {t:.2f} | {base / r:.2f}x | {100 * acc:.2f} |")


def transport_rank() -> None:
    """Under torchrun (2 ranks): rank 1 sends rank 0 fifty 199,210-float uploads, as pickled objects
    (``gather_object``) and as fedskew's messages (float tensors as one flat tensor)."""
    import torch
    import torch.distributed as dist

    from fedskew.engine.distributed import recv, send

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    uploads = [{"model.w": torch.randn(199_210)} for _ in range(50)]
    times = {"pickled objects (gather_object)": [], "fedskew messages (send/recv)": []}
    for _ in range(3):
        t0 = time.perf_counter()
        dist.gather_object(uploads, [None, None] if rank == 0 else None, dst=0)
        times["pickled objects (gather_object)"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if rank == 1:
            send(uploads, 0, None)
        else:
            recv(1, None, torch.device("cpu"))
        times["fedskew messages (send/recv)"].append(time.perf_counter() - t0)
    if rank == 0:
        print("\n| 50 uploads of 199,210 floats, rank 1 -> rank 0 | seconds (best of 3) |\n|---|---|")
        for label, ts in times.items():
            print(f"| {label} | {min(ts):.3f} |")
    dist.destroy_process_group()


def transport() -> None:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--master_addr=127.0.0.1", f"--master_port={free_port()}", __file__, "--transport-rank"],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    print(done.stdout, flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get("FEDSKEW_DATA", "data"),
                   help="folder holding Fashion-MNIST's IDX files (default $FEDSKEW_DATA, else ./data)")
    p.add_argument("--rounds", type=int, default=4, help="rounds of the 100-client run (the first is not timed)")
    p.add_argument("--epochs", type=int, nargs="+", default=[1, 5], help="local epochs of the 100-client runs")
    p.add_argument("--out", default=None)
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--transport-rank", action="store_true", help=argparse.SUPPRESS)  # (run by transport())
    args = p.parse_args()
    if args.transport_rank:
        return transport_rank()
    out = Path(args.out or tempfile.mkdtemp(prefix="scaling_"))
    out.mkdir(parents=True, exist_ok=True)
    if not args.skip_sweep:
        sweep_overhead(out)
    transport()
    for epochs in args.epochs:
        round_time(out, args.data, args.rounds, epochs)
    print(f"\nfolders in {out}")


if __name__ == "__main__":
    main()
