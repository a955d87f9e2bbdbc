"""What a checkpoint writes at MAP's paper setting: client files written only for
the clients that changed, against the whole state written every round (fedskew <= 0.1.0's format).

MAP (100 clients, 20 a round, the authors' MLPNet; each client keeps its HPM model) for a few
rounds on a fraction of Fashion-MNIST (digits when Fashion-MNIST is absent: the model and the
client count, which set the bytes, are the same). Then, side by side in one process, alternating:
the time of `RunDir.checkpoint` for a round's 20 changed clients, and of writing the same state
whole (one file, every client inline). Prints bytes and seconds per checkpoint and their ratios.

    python benchmarks/checkpoint_io.py [--rounds 8] [--repeats 3] [--data DATA_DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import fedskew
from fedskew.engine.durable import atomic_save
from fedskew.engine.rundir import ClientStates, RunDir, read_checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--data", default=os.environ.get("FEDSKEW_DATA", "data"),
                   help="folder with Fashion-MNIST (default $FEDSKEW_DATA, else ./data; digits without it)")
    p.add_argument("--json", help="also write the figures to this JSON file (for docs/performance.md)")
    args = p.parse_args()
    fmnist = any(Path(args.data).glob("**/train-images-idx3-ubyte*"))
    dataset = ({"name": "fmnist", "root": args.data, "train_subsample": 0.05} if fmnist else "digits")
    cfg = {"dataset": dataset, "model": "mlpnet", "method": "map", "model.classifier_bias": False,
           "partition": {"name": "random_classes", "num_clients": 100}, "clients_per_round": 20,
           "rounds": args.rounds, "local_epochs": 1, "batch_size": 64, "lr": 0.03, "momentum": 0.9,
           "final_personalization": False}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, written = Path(tmp) / "map", []

        def on_round(record):  # the files this round's checkpoint wrote (the next checkpoint may remove them)
            files = list((run_dir / "clients").glob(f"*-{record['round'] + 1}.pt"))
            head = (run_dir / "checkpoint.pt").stat().st_size  # global model, server state, file names
            written.append((len(files), sum(f.stat().st_size for f in files) + head, head))

        res = fedskew.run(cfg, out_dir=tmp, run_name="map", on_round=on_round)
        ckpt = read_checkpoint(run_dir / "checkpoint.pt")
        states = ckpt["client_states"]
        nbytes = {k: sum(v.numel() * v.element_size() for v in st.values()) for k, st in states.items()}
        print(f"MAP, {'fmnist (5 %)' if fmnist else 'digits'}, mlpnet, 100 clients, 20 a round, {args.rounds} rounds; "
              f"{len(states)} clients hold a state, {sum(nbytes.values()) / 2**20:.1f} MiB of tensors in all")
        print("round  client-files  written(MiB)  whole-state(MiB)  ratio")
        for t, (count, size, head) in enumerate(written):
            visited = {k for r in res.history[: t + 1] for k in r["clients"]}
            whole = head + sum(nbytes[k] for k in visited)
            print(f"{t + 1:5d}  {count:12d}  {size / 2**20:12.1f}  {whole / 2**20:16.1f}  {whole / size:5.1f}x")
        # side by side: the last round's 20 clients changed (a round at steady state), or the whole state
        last = res.history[-1]["clients"]
        ours, old = [], []
        for i in range(args.repeats):
            files = RunDir(run_dir)  # as the run left it: the files and their digests the checkpoint names
            files.client_files, files.current_ok = dict(ckpt["client_files"]), True
            files.client_digests = dict(ckpt["client_digests"])
            changing = ClientStates(states, changed=False)
            for k in last:
                changing[k] = states[k]
            t0 = time.perf_counter()
            files.checkpoint({**ckpt, "next_round": 1000 + i, "client_states": changing})
            t1 = time.perf_counter()
            wrote = len(list((run_dir / "clients").glob(f"*-{1000 + i}.pt")))
            if wrote != len(set(last)):  # (a RunDir without the digests rewrites every client)
                raise SystemExit(f"the checkpoint wrote {wrote} client files, not the {len(set(last))} that changed")
            atomic_save({**{k: v for k, v in ckpt.items() if k != "client_files"}, "client_states": dict(states)},
                        Path(tmp) / "whole.pt")
            t2 = time.perf_counter()
            ours.append(t1 - t0)
            old.append(t2 - t1)
            ckpt["client_files"], ckpt["client_digests"] = files.client_files, files.client_digests
        whole_file = (Path(tmp) / "whole.pt").stat().st_size
        changed_bytes = sum((run_dir / "clients" / f"{k}-{1000 + args.repeats - 1}.pt").stat().st_size
                            for k in set(last)) + (run_dir / "checkpoint.pt").stat().st_size
        a, b = statistics.median(ours), statistics.median(old)
        print(f"one checkpoint at steady state ({len(set(last))} clients changed), median of {args.repeats}, "
              f"torch {torch.__version__}:")
        print(f"  client files: {changed_bytes / 2**20:8.1f} MiB  {a:6.3f} s")
        print(f"  whole state:  {whole_file / 2**20:8.1f} MiB  {b:6.3f} s")
        print(f"  ratio (whole / client files): bytes {whole_file / changed_bytes:.1f}x, time {b / a:.1f}x")
        if args.json:
            from common import write_result

            write_result(args.json, "checkpoint", "Checkpoints write the clients that changed",
                         ["what a checkpoint writes", "MiB", "seconds"],
                         [["the changed clients' files", changed_bytes / 2**20, a],
                          ["the whole state (every client inline)", whole_file / 2**20, b],
                          ["ratio, whole / changed", whole_file / changed_bytes, b / a]],
                         f"MAP, {'Fashion-MNIST (5 %)' if fmnist else 'digits'}, MLPNet, 100 clients, 20 a round, "
                         f"{args.rounds} rounds; one checkpoint at steady state ({len(set(last))} clients changed), "
                         f"the median of {args.repeats}.")


if __name__ == "__main__":
    main()
