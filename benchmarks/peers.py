"""fedskew beside PFLlib and FL-bench: one task, one partition, each framework in a process of its own.

The task: Fashion-MNIST, fedskew's pcdd partition of 20 clients with 2 classes each (per seed), MLP
784-200-200-10 (ReLU), SGD lr 0.01 without momentum, batch 64, 1 local epoch, all clients every
round, 20 rounds, one torch thread. The partition is written into each framework's own on-disk
format: every client trains on the same samples in all three (fedskew's local training split of
the client), and each framework's final global model is scored on the official 10,000-image test
set (PFLlib and FL-bench pool their clients' test files: the official test images of each class
are dealt out to the clients that hold the class, so the pool is the test set).

Each (method, seed) runs fedskew (sequential and vectorised executors), PFLlib and FL-bench one after
another, one process each, before the next (method, seed) starts: machine noise is shared. A process
reports its rounds' training and evaluation seconds apart (wall and CPU) and its final accuracy; the
parent adds whole-process CPU and wall time and peak RSS (``os.wait4``). Nothing of a peer is copied
here: the peers run from the user's clones, through their own entry points (``main.py``), with
small wrappers that time their functions from outside (``--worker``). The files this writes into a
clone: PFLlib ``dataset/FashionMNIST-fedskew/`` and ``results/``, FL-bench ``data/fmnist/`` (refused
when it holds a partition this script did not write) and ``out/``.

    python benchmarks/peers.py --data DIR --pfllib PFLLIB_CLONE --flbench FLBENCH_CLONE \\
        --json benchmarks/results/peers-cpu.json
    python benchmarks/peers.py --data DIR --pfllib P --flbench F --methods fedavg --seeds 0 --rounds 3

Needs, beside fedskew, what the peers import, in the same environment so that every framework runs
on the same torch build: PFLlib's h5py, scikit-learn, torchvision, cvxpy, calmsize, matplotlib;
FL-bench's hydra-core, omegaconf, ray, rich, pynvml, pandas, Pillow, scikit-learn, torchvision.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common import hardware, parser, write_result

FRAMEWORKS = ("fedskew-sequential", "fedskew-vectorized", "pfllib", "flbench")
METHODS = ("fedavg", "fedprox", "scaffold")
PFL_NAME = "FashionMNIST-fedskew"  # PFLlib picks its MNIST models by "MNIST" in the name
PFL_ALGO = {"fedavg": ["-algo", "FedAvg"], "fedprox": ["-algo", "FedProx", "-mu", "0.01"],
            "scaffold": ["-algo", "SCAFFOLD", "-slr", "1.0"]}
MARKER = ".written-by-fedskew-peers"
MEAN, STD = 0.2860, 0.3530  # fedskew's Fashion-MNIST normalisation, written into PFLlib's files too


def task(args, seed: int) -> list[str]:
    return ["dataset=fmnist", f"dataset.root={args.data}", "model=mlp", "model.hidden=[200,200]", "partition=pcdd",
            f"partition.num_clients={args.clients}", "partition.classes_per_client=2",
            f"clients_per_round={args.clients}", f"rounds={args.rounds}", "local_epochs=1", "batch_size=64",
            "lr=0.01", "momentum=0", "eval_every=1", "final_personalization=false", f"seed={seed}"]


# -- the partition, in each framework's format -------------------------------------------------------------


def idx_file(data: Path, name: str) -> np.ndarray:
    """An IDX file of ``data`` (gzipped or not) as a numpy array."""
    path = next((p for p in (data / name, data / f"{name}.gz", data / "fashion-mnist" / f"{name}.gz",
                             data / "fashion-mnist" / name) if p.exists()), None)
    if path is None:
        raise SystemExit(f"benchmarks/peers.py: Fashion-MNIST's {name} is not in {data} (--data)")
    raw = (gzip.open if path.suffix == ".gz" else open)(path, "rb").read()
    dims = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def partition(args, seed: int, y_official: np.ndarray, y_test: np.ndarray) -> list[dict]:
    """fedskew's partition of the seed: per client its training rows (into the official 60k) and
    the official test images dealt out by class to the clients holding the class."""
    from fedskew.config import load_config
    from fedskew.engine.runner import load_federation

    fed = load_federation(load_config(None, task(args, seed)))
    train = [idx.numpy() for idx in fed.train_idx]
    y_train = fed.data.y_train.numpy()
    if not np.array_equal(y_train, y_official):  # fedskew's rows are the official training images, in order
        raise SystemExit("benchmarks/peers.py: fedskew's Fashion-MNIST training table is not the official one")
    tests = deal_test([np.unique(y_train[idx]) for idx in train], y_test)
    return [{"train": t, "test": s} for t, s in zip(train, tests)]


def deal_test(classes: list[np.ndarray], y_test: np.ndarray) -> list[np.ndarray]:
    """Each client's share of the test set: the test images of each class split into equal
    contiguous parts among the clients holding the class (``classes[k]``: client k's), in client
    order; every image goes to exactly one client."""
    tests: list[list] = [[np.zeros(0, dtype=np.int64)] for _ in classes]
    for c in np.unique(y_test):
        holders = [k for k, cs in enumerate(classes) if c in cs]
        if not holders:
            raise SystemExit(f"benchmarks/peers.py: class {c} is held by no client; its test images would go unscored")
        for k, part in zip(holders, np.array_split(np.flatnonzero(y_test == c), len(holders))):
            tests[k].append(part)
    return [np.sort(np.concatenate(t)) for t in tests]


def write_pfllib(root: Path, parts, x_train, y_train, x_test, y_test) -> None:
    d = root / "dataset" / PFL_NAME
    if d.exists() and not (d / MARKER).exists():
        raise SystemExit(f"benchmarks/peers.py: {d} holds files this script did not write; move it away (or use a "
                         f"clone of PFLlib of its own) and run again")
    for split in ("train", "test"):
        (d / split).mkdir(parents=True, exist_ok=True)
    (d / MARKER).write_text("")
    for k, p in enumerate(parts):
        for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
            rows = p[split]
            xs = ((x[rows].astype(np.float32) / 255.0 - MEAN) / STD).reshape(-1, 1, 28, 28)
            with open(d / split / f"{k}.npz", "wb") as fh:
                np.savez(fh, data={"x": xs, "y": y[rows].astype(np.int64)})


def write_flbench(root: Path, parts, data: Path) -> None:
    d = root / "data" / "fmnist"
    theirs = [f for f in ("partition.pkl", "args.json") if (d / f).exists()]
    if theirs and not (d / MARKER).exists():
        raise SystemExit(f"benchmarks/peers.py: {d / theirs[0]} holds a partition this script did not write; "
                         f"move it away (or use a clone of FL-bench of its own) and run again")
    raw = d / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    (d / MARKER).write_text("")  # (first: a run cut short leaves files this script may write again)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        if not (raw / name).exists():
            src = next(p for p in (data / f"{name}.gz", data / "fashion-mnist" / f"{name}.gz", data / name,
                                   data / "fashion-mnist" / name) if p.exists())
            (raw / name).write_bytes((gzip.open if src.suffix == ".gz" else open)(src, "rb").read())
    ids = list(range(len(parts)))
    with open(d / "partition.pkl", "wb") as fh:  # test rows follow the 60,000 training images in FL-bench's table
        pickle.dump({"separation": {"train": ids, "val": ids, "test": ids, "total": len(parts)},
                     "data_indices": [{"train": p["train"].astype(np.int64), "val": np.zeros(0, np.int64),
                                       "test": 60000 + p["test"].astype(np.int64)} for p in parts]}, fh)
    (d / "args.json").write_text(json.dumps({"client_num": len(parts), "split": "sample", "seed": 0}))


# -- workers: one framework's run, in its own process ------------------------------------------------------


class Clock:
    """Rounds' wall and CPU seconds, with the evaluation inside them counted apart."""

    def __init__(self):
        self.rounds: list[dict] = []
        self.eval_wall = self.eval_cpu = 0.0
        self.mark = None

    def round_boundary(self):
        now = (time.perf_counter(), time.process_time())
        if self.mark is not None:
            wall, cpu = now[0] - self.mark[0], now[1] - self.mark[1]
            self.rounds.append({"train_wall": wall - self.eval_wall, "train_cpu": cpu - self.eval_cpu,
                                "eval_wall": self.eval_wall, "eval_cpu": self.eval_cpu})
        self.mark, self.eval_wall, self.eval_cpu = now, 0.0, 0.0

    def evaluation(self, fn):
        def timed(*a, **k):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                self.eval_wall += time.perf_counter() - w
                self.eval_cpu += time.process_time() - c
        return timed


def fedskew_worker(args, executor: str, method: str, seed: int, out: Path) -> dict:
    import torch

    from round_cost import Run

    torch.set_num_threads(1)
    cfg = task(args, seed) + [f"method={method}", f"executor={executor}"]
    run = Run(cfg, out / "run")
    rounds, acc = [], None
    for t in range(args.rounds):
        rec = run.round(t)
        rounds.append({"train_wall": rec["wall"] - rec["local_eval_wall"] - rec["global_eval_wall"],
                       "train_cpu": rec["cpu"] - rec["local_eval_cpu"] - rec["global_eval_cpu"],
                       "eval_wall": rec["local_eval_wall"] + rec["global_eval_wall"],
                       "eval_cpu": rec["local_eval_cpu"] + rec["global_eval_cpu"]})
        acc = rec["acc"]
    return {"rounds": rounds, "test_acc": acc}


def pfllib_worker(args, method: str, seed: int, out: Path) -> dict:
    """PFLlib's ``system/main.py``, its DNN swapped for the task's MLP (PFLlib has no 784-200-200-10
    model) and its fixed ``torch.manual_seed(0)`` given the run's seed; numpy's and random's
    generators (PFLlib draws client order and aggregation order from them unseeded) seeded too."""
    import random
    import runpy

    import torch
    from torch import nn

    system = Path(args.pfllib).resolve() / "system"
    os.chdir(system)
    sys.path.insert(0, str(system))
    torch.set_num_threads(1)
    manual_seed = torch.manual_seed
    torch.manual_seed = lambda s: manual_seed(s + seed)  # main.py and every client call manual_seed(0)
    random.seed(seed)
    np.random.seed(seed)
    import flcore.servers.serverbase as base
    import flcore.trainmodel.models as models

    class TaskMLP(nn.Module):  # called as DNN(784, 100, num_classes=10); fc is the head PFLlib's split expects
        def __init__(self, *a, num_classes=10, **k):
            super().__init__()
            self.fc1, self.fc2, self.fc = nn.Linear(784, 200), nn.Linear(200, 200), nn.Linear(200, num_classes)

        def forward(self, x):
            return self.fc(torch.relu(self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))))

    TaskMLP.__module__ = models.__name__
    models.TaskMLP = models.DNN = TaskMLP
    clock = Clock()
    select, evaluate = base.Server.select_clients, base.Server.evaluate

    def select_clients(self):
        clock.round_boundary()
        return select(self)

    def timed_evaluate(self, *a, **k):
        clock.evaluation(evaluate)(self, *a, **k)
        if len(self.rs_test_acc) == args.rounds + 1:  # the model after the last round, scored: done
            clock.round_boundary()
            raise Finished(float(self.rs_test_acc[-1]))

    base.Server.select_clients, base.Server.evaluate = select_clients, timed_evaluate
    sys.argv = ["main.py", "-data", PFL_NAME, "-m", "DNN", "-ncl", "10", "-nc", str(args.clients), "-jr", "1",
                "-gr", str(args.rounds), "-ls", "1", "-lbs", "64", "-lr", "0.01", "-dev", "cpu", "-eg", "1",
                "-go", f"fedskew-peers-s{seed}", *PFL_ALGO[method]]
    try:
        runpy.run_path("main.py", run_name="__main__")
    except Finished as done:
        # PFLlib's loop step i scores the model of i rounds, then trains round i + 1: round i + 1 is the
        # training of step i and the evaluation of step i + 1
        r = clock.rounds
        return {"rounds": [{"train_wall": a["train_wall"], "train_cpu": a["train_cpu"], "eval_wall": b["eval_wall"],
                            "eval_cpu": b["eval_cpu"]} for a, b in zip(r, r[1:])], "test_acc": done.acc}
    raise RuntimeError("PFLlib finished without scoring the last round's model")


class Finished(Exception):
    def __init__(self, acc: float):
        super().__init__()
        self.acc = acc


def flbench_worker(args, method: str, seed: int, out: Path) -> dict:
    """FL-bench's ``main.py`` under Hydra; ``train_one_round`` timed as training, its server and
    client tests as evaluation. SCAFFOLD's ``local_epoch`` counts mini-batch steps in FL-bench
    (src/client/scaffold.py), so it gets the clients' mean number of batches in an epoch."""
    import torch

    root = Path(args.flbench).resolve()
    os.chdir(root)
    sys.path.insert(0, str(root))
    torch.set_num_threads(1)
    import main as flb
    from src.server.fedavg import FedAvgServer

    clock = Clock()
    train_one_round = FedAvgServer.train_one_round

    def timed_round(self):
        clock.round_boundary()
        return train_one_round(self)

    FedAvgServer.train_one_round = timed_round
    FedAvgServer.test_global_model = clock.evaluation(FedAvgServer.test_global_model)
    FedAvgServer.test_client_models = clock.evaluation(FedAvgServer.test_client_models)
    result = {}
    show = FedAvgServer.show_max_metrics

    def finish(self):
        clock.round_boundary()
        last = self.test_results[args.rounds]["centralized"]["before"]["test"]
        result.update(test_acc=last.accuracy / 100, test_size=last.size)
        if hasattr(self, "c_local"):  # SCAFFOLD: does the server hold any client's control variate after the run?
            result["client_controls_nonzero"] = sum(any(bool(c.any()) for c in cs) for cs in self.c_local)
            result["global_control_nonzero"] = any(bool(c.any()) for c in self.c_global)
        return show(self)

    FedAvgServer.show_max_metrics = finish
    parts = json.loads((out / "steps.json").read_text())
    epochs = round(statistics.mean(parts)) if method == "scaffold" else 1
    sys.argv = ["main.py", "--config-path", str(root / "config"), "--config-name", "defaults",
                f"method={method}", "dataset.name=fmnist", "model.name=2nn",
                "model.use_torchvision_pretrained_weights=false", "optimizer.name=sgd", "optimizer.lr=0.01",
                "optimizer.momentum=0", "optimizer.weight_decay=0", "mode=serial", f"common.seed={seed}",
                "common.join_ratio=1.0", f"common.global_epoch={args.rounds}", f"common.local_epoch={epochs}",
                "common.batch_size=64", "common.client_side_evaluation=false", "common.test.server.interval=1",
                "common.test.server.test=true", "common.test.client.interval=0", "common.use_cuda=false",
                "common.save_learning_curve_plot=false", "common.save_model=false", "common.verbose_gap=100000",
                "common.monitor=null", f"hydra.run.dir={out / 'flbench'}"]
    if method == "fedprox":
        sys.argv.append("fedprox.mu=0.01")
    flb.main()
    return {"rounds": clock.rounds, "local_epoch": epochs, **result}


def worker(args) -> None:
    framework, method, seed, out = args.worker[0], args.worker[1], int(args.worker[2]), Path(args.worker[3])
    if framework.startswith("fedskew"):
        result = fedskew_worker(args, framework.split("-")[1], method, seed, out)
    elif framework == "pfllib":
        result = pfllib_worker(args, method, seed, out)
    else:
        result = flbench_worker(args, method, seed, out)
    (out / "result.json").write_text(json.dumps(result))


# -- the parent: data, runs interleaved, the table ----------------------------------------------------------


def commit_of(path: str) -> str:
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def spawn(args, framework: str, method: str, seed: int, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--data", args.data, "--pfllib", args.pfllib or "",
           "--flbench", args.flbench or "", "--rounds", str(args.rounds), "--clients", str(args.clients),
           "--worker", framework, method, str(seed), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (out / "log.txt").read_text()[-2000:]
        raise SystemExit(f"benchmarks/peers.py: {framework} {method} seed {seed} failed ({out / 'log.txt'}):\n{tail}")
    result = json.loads((out / "result.json").read_text())
    result.update(process_wall=wall, process_cpu=usage.ru_utime + usage.ru_stime, peak_rss_mib=usage.ru_maxrss / 1024)
    return result


def summary(results: dict, framework: str, method: str) -> dict:
    runs = results[framework][method]
    med = {k: statistics.mean(statistics.median(r[k] for r in run["rounds"]) for run in runs)
           for k in ("train_wall", "train_cpu", "eval_wall", "eval_cpu")}
    accs = [100 * run["test_acc"] for run in runs]
    return {**med, "acc_mean": statistics.mean(accs), "acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "process_cpu": statistics.mean(r["process_cpu"] for r in runs),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in runs)}


def main():
    p = parser(__doc__)
    p.add_argument("--pfllib", help="a clone of TsingZ0/PFLlib")
    p.add_argument("--flbench", help="a clone of KarhouTam/FL-bench")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--json", default=None, help="write the figure here (benchmarks/results/peers-cpu.json)")
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)  # (internal: one framework's run)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    frameworks = [f for f in args.frameworks if f.startswith("fedskew") or getattr(args, f)]
    out = Path(args.out or "peers-runs").resolve()
    data = Path(args.data)
    x_train, y_train = idx_file(data, "train-images-idx3-ubyte"), idx_file(data, "train-labels-idx1-ubyte")
    x_test, y_test = idx_file(data, "t10k-images-idx3-ubyte"), idx_file(data, "t10k-labels-idx1-ubyte")
    results = {f: {m: [] for m in args.methods} for f in frameworks}
    for seed in args.seeds:
        parts = partition(args, seed, y_train, y_test)
        if args.pfllib:
            write_pfllib(Path(args.pfllib), parts, x_train, y_train, x_test, y_test)
        if args.flbench:
            write_flbench(Path(args.flbench), parts, data)
        steps = [-(-len(p["train"]) // 64) for p in parts]
        for method in args.methods:
            for framework in frameworks:
                run_dir = out / f"{framework}-{method}-s{seed}"
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "steps.json").write_text(json.dumps(steps))
                r = spawn(args, framework, method, seed, run_dir)
                results[framework][method].append(r)
                print(f"seed {seed} {method:8s} {framework:18s} acc {100 * r['test_acc']:.2f}  train "
                      f"{statistics.median(x['train_cpu'] for x in r['rounds']):.3f} cpu s/round  eval "
                      f"{statistics.median(x['eval_cpu'] for x in r['rounds']):.3f}  process {r['process_cpu']:.1f} "
                      f"cpu s  rss {r['peak_rss_mib']:.0f} MiB", flush=True)
    (out / "results.json").write_text(json.dumps(results))
    rows = []
    for method in args.methods:
        base = summary(results, frameworks[0], method)
        for f in frameworks:
            s = summary(results, f, method)
            rows.append([method, f, f"{s['acc_mean']:.2f} +- {s['acc_std']:.2f}", s["train_cpu"], s["eval_cpu"],
                         s["train_wall"] + s["eval_wall"], s["process_cpu"], s["peak_rss_mib"],
                         (s["train_cpu"] + s["eval_cpu"]) / (base["train_cpu"] + base["eval_cpu"]),
                         s["train_cpu"] / base["train_cpu"]])
    for r in rows:
        print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r))
    if args.json:
        commits = {"pfllib": commit_of(args.pfllib) if args.pfllib else None,
                   "flbench": commit_of(args.flbench) if args.flbench else None}
        write_result(args.json, "peers", "fedskew beside PFLlib and FL-bench",
                     ["method", "framework", "test accuracy %", "training CPU s a round", "evaluation CPU s a round",
                      "wall s a round", "process CPU s", "peak RSS MiB", f"CPU a round / {frameworks[0]}",
                      f"training CPU / {frameworks[0]}"], rows,
                     notes=f"Fashion-MNIST, fedskew's pcdd partition ({args.clients} clients x 2 classes) written into "
                           f"each framework's format, MLP 784-200-200-10, SGD lr 0.01, batch 64, 1 epoch, all clients, "
                           f"{args.rounds} rounds, one torch thread; seeds {' '.join(map(str, args.seeds))} (accuracy "
                           f"mean +- std of the last round's global model on the official test set; seconds the mean "
                           f"over seeds of each run's median round). PFLlib {commits['pfllib']}, FL-bench "
                           f"{commits['flbench']}. Hardware: {hardware()}.")
        record = json.loads(Path(args.json).read_text())
        record["command"] = public_command(record["command"])
        record["observations"] = observations(results, args)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


def public_command(command: str) -> str:
    """The command as a reader reruns it: the clones' paths as placeholders, the runs' folder left out."""
    import shlex

    words, out = shlex.split(command), []
    for i, w in enumerate(words):
        if i and words[i - 1] == "--out" or w == "--out":
            continue
        out.append({"--pfllib": "PFLLIB_CLONE", "--flbench": "FLBENCH_CLONE"}.get(words[i - 1], w) if i else w)
    return shlex.join(out)


def observations(results: dict, args) -> list[str]:
    """Sentences about the peers' runs that the table does not show, from the runs themselves."""
    out = []
    runs = results.get("flbench", {}).get("scaffold", [])
    if runs:
        held = [r["client_controls_nonzero"] for r in runs]
        out.append(f"FL-bench's SCAFFOLD: after the last round its server held a nonzero control variate for "
                   f"{', '.join(map(str, held))} of {args.clients} clients (seeds {', '.join(map(str, args.seeds))}); "
                   f"its global control was nonzero in {sum(r['global_control_nonzero'] for r in runs)} of "
                   f"{len(runs)} runs. Each client ran local_epoch = {runs[0]['local_epoch']} steps a round.")
    return out


if __name__ == "__main__":
    main()
