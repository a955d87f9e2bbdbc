"""Engine speed: the same local training, side by side in one process.

Engines: (bare) a PyTorch loop written by hand (load global weights, SGD over the client's batches,
local-test accuracy before/after, weighted average; FedAvg only), (sequential) fedskew's sequential
executor, (sequential-cl) the same with ``channels_last=on`` (convolutions and image batches in the
NHWC layout), (grouped) the vectorised executor with one call per batch-size group of a step
(``pad_batches=false``), (padded) the vectorised executor with one padded call per step (its
default where exact), (flower) Flower's simulation engine running the same client training inside
a ClientApp with Flower's FedAvg strategy (``--flower``; 10 and 100 clients).

Every engine trains the same clients on the same batches each round. Rounds are timed interleaved
(bare, sequential, grouped, padded, bare, ...) after one warm-up round each and the median is
reported, so machine noise hits all engines alike. Flower is timed per round from its own
evaluate_fn timestamps, first round (actor start-up) dropped.

    python benchmarks/engine_speed.py                     # digits: 10 and 100 clients, mlp / tcnn / cnnbn
    python benchmarks/engine_speed.py --clients 1000 --dataset fmnist --subsample 0.25 --models mlp tcnn \\
        --engines sequential grouped padded --rounds 3    # 1,000 clients (~12 samples each)
    python benchmarks/engine_speed.py --paper map fedmr etf --data DIR   # one paper-scale round each
    python benchmarks/engine_speed.py --memory            # 100 stateful clients: stacked state by chunk size

``--paper``: the seed papers' settings, FedAvg's local training unless noted (the engine overhead
question: same epochs, same model): ``map`` MAP Table I, Fashion-MNIST MLPNet 784-1024-1024-128, 100
clients random_classes, 20 per round, E = 5, B = 64, method MAP itself; ``fedmr`` FedMR Table 1,
CIFAR-10 ResNet-18, 10 clients pcdd 2 classes, all selected, E = 10, B = 64; ``etf`` the
neural-collapse paper, CIFAR-10 VGG-11, 100 clients label_count (2 classes x 125 samples), 10 per
round, E = 2, B = 64. CIFAR-10 is read from ``--data`` when it is there; otherwise random pixels are
written in CIFAR-10's on-disk format (timing does not depend on pixel values) and the table says so.
``--paper-fraction f`` trains each client on a fraction f of its samples (the data set subsampled;
``etf``: f x 125 samples per class) and projects the full round as measured / f: what a CPU can
time. VGG-11 has dropout, which the vectorised executor does not run (random masks under vmap
would not match the sequential executor's), so ``etf`` runs sequentially there after a notice.
"""

from __future__ import annotations

import argparse
import atexit
import os
import pickle
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedskew.config import load_config
from fedskew.engine.local import federated_state
from fedskew.engine.protocol import batch_schedule
from fedskew.engine.runner import Experiment
from fedskew.streams import sample_clients

MODELS = {"mlp": ["model=mlp", "model.hidden=[64,64]"], "mlp200": ["model=mlp", "model.hidden=[200,200]"],
          "tcnn": ["model=tcnn"], "cnnbn": ["model=cnnbn", "model.width=16"], "simplecnn": ["model=simplecnn"]}
ENGINES = ("bare", "sequential", "sequential-cl", "grouped", "padded", "flower")


def engine_overrides(engine: str) -> list[str]:
    return {"bare": ["executor=sequential"], "sequential": ["executor=sequential"], "flower": ["executor=sequential"],
            "sequential-cl": ["executor=sequential", "channels_last=on"],
            "grouped": ["executor=vectorized", "pad_batches=false"], "padded": ["executor=vectorized"]}[engine]


class Bare:
    """What a user writes by hand with plain PyTorch (FedAvg)."""

    def __init__(self, exp: Experiment):
        self.exp, self.model = exp, exp.model
        self.state = federated_state(exp.model)
        self.settings = exp.executor.settings
        self.x, self.y = exp.executor.x, exp.executor.y  # on the run's device, as the executors read them

    def local_acc(self, idx):
        self.model.eval()
        with torch.no_grad():
            acc = (self.model(self.x[idx]).argmax(1) == self.y[idx]).float().mean()
        self.model.train()
        return acc

    def round(self, t: int, clients: list[int], lr: float):
        fed, s, model = self.exp.fed, self.settings, self.model
        new, total = None, 0
        for k in clients:
            model.load_state_dict(self.state, strict=False)
            self.local_acc(self.exp.executor.test_idx[k])
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=s.momentum, weight_decay=s.weight_decay)
            idx = self.exp.executor.train_idx[k]
            for pos in batch_schedule(s, t, k, len(idx)):
                rows = idx[torch.from_numpy(pos).to(idx.device)]
                loss = F.cross_entropy(model(self.x[rows]), self.y[rows])
                opt.zero_grad()
                loss.backward()
                opt.step()
            self.local_acc(self.exp.executor.test_idx[k])
            n = len(fed.train_idx[k])
            trained = federated_state(model)
            new = {key: v * n for key, v in trained.items()} if new is None else \
                {key: new[key] + v * n for key, v in trained.items()}
            total += n
        self.state = {key: v / total for key, v in new.items()}
        sync(self.exp.device)


class Engine:
    """One fedskew round through the executor, the method's broadcast, client states and aggregate."""

    def __init__(self, exp: Experiment):
        self.exp, m = exp, exp.method
        self.state = federated_state(exp.model)
        self.server = m.server_init(self.state, m.info)
        self.clients: dict[int, dict] = {}

    def round(self, t: int, clients: list[int], lr: float):
        m = self.exp.method
        payload = m.broadcast(self.state, self.server)
        states = {k: self.clients[k] if k in self.clients else m.client_init(k, self.state, m.info) for k in clients}
        results = self.exp.executor.train_round(t, clients, payload, states, lr)
        for r in results:
            self.clients[r.client_id] = r.client_state
        self.state, self.server = m.aggregate(self.server, self.state, [r.upload for r in results],
                                              [r.report for r in results])
        sync(self.exp.device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(engine: str, overrides: list[str]):
    exp = Experiment(load_config(None, overrides + engine_overrides(engine)))
    return Bare(exp) if engine == "bare" else Engine(exp)


def time_engines(overrides: list[str], engines: list[str], rounds: int, log=None) -> tuple[dict, Experiment]:
    """Median seconds per round of each engine (interleaved), and one engine's experiment; ``log``
    gets each round's time as it is measured (what a cut run still reports)."""
    built = {e: build(e, overrides) for e in engines}
    exp = list(built.values())[-1].exp  # the last engine's (vectorised, when timed)
    cfg, n = exp.cfg, exp.fed.num_clients
    per_round = cfg.clients_per_round if isinstance(cfg.clients_per_round, int) else n
    picks = [sample_clients(cfg.seed, t, n, min(per_round, n)) for t in range(rounds + 1)]
    for name, eng in built.items():  # warm-up: first-call costs (allocations, the padding check)
        t0 = time.perf_counter()
        eng.round(0, picks[0], cfg.lr)
        if log:
            log(f"  {name}: warm-up round {time.perf_counter() - t0:.2f} s")
    times = {e: [] for e in built}
    for t in range(1, rounds + 1):
        for name, eng in built.items():
            t0 = time.perf_counter()
            eng.round(t, picks[t], cfg.lr)
            times[name].append(time.perf_counter() - t0)
            if log:
                log(f"  {name}: round {t} {times[name][-1]:.3f} s")
    return {k: statistics.median(v) for k, v in times.items()}, exp


def flower_round_seconds(cfg, rounds: int) -> float | None:
    """Median seconds per round under flwr.simulation.run_simulation (Ray backend)."""
    try:
        from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
        from flwr.clientapp import ClientApp
        from flwr.serverapp import Grid, ServerApp
        from flwr.serverapp.strategy import FedAvg
        from flwr.simulation import run_simulation
    except ImportError:
        return None
    import logging

    from fedskew.algorithms.base import as_model_part

    logging.getLogger("flwr").setLevel(logging.ERROR)
    cfg_json = cfg.model_dump(mode="json")
    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context):
        from fedskew.config import validate_config
        from fedskew.engine.runner import Experiment as Exp

        global _EXP
        if "_EXP" not in globals():
            _EXP = Exp(validate_config(cfg_json))
        k = int(context.node_config["partition-id"])
        start = msg.content["arrays"].to_torch_state_dict()
        res = _EXP.executor.train_client(
            int(msg.content["config"]["server-round"]), k, as_model_part(start), {}, cfg.lr
        )
        trained = {key[len("model."):]: v for key, v in res.upload.items()}
        content = RecordDict({"arrays": ArrayRecord(trained),
                              "metrics": MetricRecord({"num-examples": res.report.num_samples})})
        return Message(content=content, reply_to=msg)

    stamps: list[float] = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context):
        exp = Experiment(cfg)
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=cfg.partition.num_clients,
                          min_available_nodes=cfg.partition.num_clients)

        def evaluate_fn(server_round, arrays):
            stamps.append(time.perf_counter())
            return None

        strategy.start(grid=grid, initial_arrays=ArrayRecord(federated_state(exp.model)), num_rounds=rounds,
                       evaluate_fn=evaluate_fn)

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=cfg.partition.num_clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(gaps[1:]) if len(gaps) > 1 else (gaps[0] if gaps else None)


def step_bounds(exp: Experiment, clients: list[int]) -> tuple[float, float]:
    """(bound, chunked): the seq/vec ratio a zero-overhead vectorised program could reach, the sum
    of the clients' steps over the longest client's (it runs as many steps as that client); and the
    fraction of that bound lost to chunking when ``max_parallel_clients`` < clients (sorted,
    contiguous chunks, as the executor forms them), vs perfect packing of steps into lanes."""
    steps = sorted(len(batch_schedule(exp.executor.settings, 0, k, len(exp.fed.train_idx[k]))) for k in clients)
    bound = sum(steps) / max(steps[-1], 1)
    size = getattr(exp.executor, "max_parallel_clients", None) or len(steps)
    chunked = sum(max(steps[i:i + size]) for i in range(0, len(steps), size))
    packed = max(steps[-1], -(-sum(steps) // size))
    return bound, chunked / packed


def engines_table(args):
    data = [f"dataset={args.dataset}"] + ([f"dataset.root={args.data}"] if args.data else []) + \
        ([f"dataset.train_subsample={args.subsample}"] if args.subsample < 1 else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}; {args.dataset}, "
          f"pcdd (3 classes/client), all clients every round, E={args.epochs}, B={args.batch}; "
          f"median seconds per round")
    rows = []
    for model in args.models:
        for clients in args.clients:
            overrides = data + [f"partition.num_clients={clients}", f"clients_per_round={clients}",
                                "partition.classes_per_client=3", *MODELS[model], f"local_epochs={args.epochs}",
                                f"batch_size={args.batch}", "final_personalization=false", f"device={args.device}",
                                f"precision={args.precision}"]
            engines = [e for e in args.engines if e != "flower"]
            med, exp = time_engines(overrides, engines, args.rounds)
            if "flower" in args.engines and clients <= 100:
                med["flower"] = flower_round_seconds(load_config(None, overrides + ["executor=sequential"]),
                                                     args.rounds + 1)
            med["bound"], _ = step_bounds(exp, list(range(clients)))
            rows.append((model, clients, med))
            print(f"{model:6s} {clients:5d} clients: " +
                  "  ".join(f"{k} {v:.3f}s" for k, v in med.items() if v is not None and k != "bound"), flush=True)
    print("\nratios (higher = the second engine is faster):")
    cols = [("seq/bare", "sequential", "bare"), ("seq/seq-cl", "sequential", "sequential-cl"),
            ("seq/grouped", "sequential", "grouped"),
            ("seq/padded", "sequential", "padded"), ("grouped/padded", "grouped", "padded"),
            ("flower/padded", "flower", "padded")]
    print(f"{'model':6s} {'clients':>7s} " + " ".join(f"{c[0]:>14s}" for c in cols) + f" {'bound':>6s}")
    for model, clients, m in rows:
        cells = [(m[a] / m[b]) if m.get(a) and m.get(b) else float("nan") for _, a, b in cols]
        print(f"{model:6s} {clients:7d} " + " ".join(f"{c:14.2f}" for c in cells) + f" {m['bound']:6.2f}")
    print("bound = sum of client steps / steps of the longest client: the seq/vec ratio a vectorised program with "
          "zero per-step overhead could reach (it runs as many steps as the longest client).")
    if args.json:
        from common import write_result

        engines = [e for e in ["bare", "sequential", "sequential-cl", "grouped", "padded", "flower"]
                   if any(m.get(e) for _, _, m in rows)]
        shown = [c for c in cols if any(m.get(c[1]) and m.get(c[2]) for _, _, m in rows)]
        write_result(args.json, "engine-speed", "Engine speed: seconds per round and ratios between executors",
                     ["model", "clients", *[f"{e} (s)" for e in engines], *[c[0] for c in shown], "bound"],
                     [[model, clients, *[m.get(e) for e in engines],
                       *[(m[a] / m[b]) if m.get(a) and m.get(b) else None for _, a, b in shown], m["bound"]]
                      for model, clients, m in rows],
                     f"{args.dataset}, pcdd (3 classes a client), every client every round, E = {args.epochs}, "
                     f"B = {args.batch}, precision {args.precision}; the median of {args.rounds} rounds. A ratio a/b "
                     f"above 1: b is faster. bound: the seq/vectorised ratio a program with no per-step overhead "
                     f"could reach (the sum of client steps over the longest client's).", args.device)


# -- paper scale -------------------------------------------------------------------------------------


def cifar_root(data: str | None) -> tuple[str, bool]:
    """A folder with CIFAR-10's python batches: ``data`` if it has them, else random pixels written
    in the official layout (True: synthetic)."""
    for root in ([data] if data else []) + ([os.environ["FEDSKEW_DATA"]] if os.environ.get("FEDSKEW_DATA") else []):
        for sub in ("", "cifar10", "cifar-10-batches-py"):
            if (Path(root) / sub / "data_batch_1").exists() or (Path(root) / sub / "cifar-10-batches-py").exists():
                return root, False
    out = Path(tempfile.mkdtemp(prefix="fedskew-cifar-")) / "cifar-10-batches-py"
    out.mkdir(parents=True)
    atexit.register(shutil.rmtree, out.parent, True)  # (180 MB of pickles, left in /tmp before)
    rng = np.random.default_rng(0)
    for name, n in [(f"data_batch_{i}", 10000) for i in range(1, 6)] + [("test_batch", 10000)]:
        batch = {b"batch_label": name.encode(), b"labels": rng.integers(0, 10, n).tolist(),
                 b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"filenames": [b"x.png"] * n}
        with open(out / name, "wb") as fh:
            pickle.dump(batch, fh, protocol=2)
    return str(out.parent), True


PAPER = {
    "map": ["dataset=fmnist", "model=mlpnet", "model.classifier_bias=false", "partition=random_classes",
            "partition.num_clients=100", "partition.local_test_fraction=0.2", "clients_per_round=20",
            "local_epochs=5", "batch_size=64", "lr=0.03", "momentum=0.9", "weight_decay=1e-5", "method=map"],
    "fedmr": ["dataset=cifar10", "model=resnet18", "partition=pcdd", "partition.num_clients=10",
              "partition.classes_per_client=2", "clients_per_round=10", "local_epochs=10", "batch_size=64",
              "lr=0.01", "momentum=0.9", "weight_decay=1e-5"],
    "etf": ["dataset=cifar10", "model=vgg11", "model.classifier=etf", "partition=label_count",
            "partition.num_clients=100", "partition.classes_per_client=2", "partition.samples_per_class=125",
            "clients_per_round=10", "local_epochs=2", "batch_size=64", "lr=0.03", "momentum=0.9",
            "weight_decay=5e-4"],
}


def paper_table(args):
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}; one round of each "
          f"paper setting, median of {args.rounds} interleaved rounds; fraction {args.paper_fraction} of the data "
          f"(projected round = measured / fraction)")
    for name in args.paper:
        overrides = list(PAPER[name]) + ["final_personalization=false", f"device={args.device}",
                                         f"precision={args.precision}"]
        note = ""
        if "dataset=cifar10" in overrides:
            root, synthetic = cifar_root(args.data)
            overrides.append(f"dataset.root={root}")
            note = " (CIFAR-10 format, random pixels)" if synthetic else ""
        elif args.data:
            overrides.append(f"dataset.root={args.data}")
        if args.paper_fraction < 1 and "partition=label_count" in overrides:  # fixed samples per class
            overrides.append(f"partition.samples_per_class={max(1, round(125 * args.paper_fraction))}")
        elif args.paper_fraction < 1:
            overrides.append(f"dataset.train_subsample={args.paper_fraction}")
        engines = [e for e in args.engines if e != "flower" and not (e == "bare" and "method=map" in overrides)]
        med, exp = time_engines(overrides, engines, args.rounds, log=lambda line: print(line, flush=True))
        pad = getattr(exp.executor, "padded", None)
        print(f"\n{name}{note}: {exp.fed.num_clients} clients, {exp.cfg.clients_per_round} per round, "
              f"{len(exp.fed.data.y_train)} training samples, model {exp.cfg.model.name}, method {exp.cfg.method.name}")
        for engine, sec in med.items():
            print(f"  {engine:10s} {sec:9.3f} s/round measured   {sec / args.paper_fraction:10.1f} s projected")
        ref = "bare" if "bare" in med else "sequential"
        print("  ratios: " + "  ".join(f"{ref}/{e} {med[ref] / v:.2f}" for e, v in med.items() if e != ref))
        if pad is not None:
            print(f"  vectorised padding: {pad}; fallback: {getattr(exp.executor, 'fallback_reason', None)}")


# -- memory ------------------------------------------------------------------------------------------


def memory_table(args):
    """100 stateful clients, all selected, one round: what the stacked state costs per chunk size."""
    print("digits, 100 clients (pcdd 3 classes), all selected, mlp 200-200, E=1; vectorised executor")
    print(f"{'method':10s} {'chunk':>6s} {'client state (host)':>20s} {'stacked state peak':>19s} {'s/round':>8s} "
          f"{'packing gain':>13s}")
    for method in ("map", "scaffold"):
        for chunk in (None, 50, 10):
            overrides = ["partition.num_clients=100", "clients_per_round=100", "partition.classes_per_client=3",
                         *MODELS["mlp200"], "local_epochs=1", "final_personalization=false", "executor=vectorized",
                         f"method={method}"] + ([f"max_parallel_clients={chunk}"] if chunk else [])
            exp = Experiment(load_config(None, overrides))
            eng = Engine(exp)
            clients = list(range(100))
            eng.round(0, clients, exp.cfg.lr)
            t0 = time.perf_counter()
            eng.round(1, clients, exp.cfg.lr)
            sec = time.perf_counter() - t0
            state = sum(v.numel() * v.element_size() for st in eng.clients.values() for v in st.values())
            _, gain = step_bounds(exp, clients)
            print(f"{method:10s} {str(chunk or 'all'):>6s} {state / 2**20:17.1f} MiB "
                  f"{exp.executor.peak_state_bytes / 2**20:16.1f} MiB {sec:8.2f} {gain:13.3f}")
    print("packing gain: steps of sorted contiguous chunks (the executor's) / steps of a perfect packing of client "
          "steps into chunk-size lanes; 1.000 = nothing to gain from load balancing.")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument(
        "--models",
        nargs="+",
        default=["mlp", "tcnn", "cnnbn"],
        choices=sorted(MODELS),
        help="mlp: 64-64 MLP; mlp200: 200-200 MLP; tcnn: CNN without BatchNorm; cnnbn: BN CNN (width 16)",
    )
    parser.add_argument("--engines", nargs="+", default=["bare", "sequential", "grouped", "padded"], choices=ENGINES)
    parser.add_argument("--flower", action="store_true", help="also time Flower's simulation engine (<= 100 clients)")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--data", default=None, help="folder with the data set's files (fmnist, cifar10)")
    parser.add_argument("--subsample", type=float, default=1.0, help="dataset.train_subsample")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per engine")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--paper", nargs="+", choices=sorted(PAPER), help="time one paper-scale round of each")
    parser.add_argument("--paper-fraction", type=float, default=1.0)
    parser.add_argument("--memory", action="store_true", help="stacked state of 100 stateful clients by chunk size")
    parser.add_argument("--json", help="also write the table to this JSON file (benchmarks/results/, for "
                                       "docs/performance.md)")
    args = parser.parse_args()
    if args.flower:
        args.engines = [*args.engines, "flower"]
    if args.precision != "fp32" and "bare" in args.engines:  # the hand-written loop has no mixed precision
        print(f"(the bare loop is not timed at precision {args.precision}: it would train in fp32)")
        args.engines = [e for e in args.engines if e != "bare"]
    if args.memory:
        memory_table(args)
    elif args.paper:
        paper_table(args)
    else:
        engines_table(args)


if __name__ == "__main__":
    main()
