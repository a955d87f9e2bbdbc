"""Engine speed: the same FedAvg work, side by side in one process.

(a) a bare PyTorch loop written by hand (load global weights, SGD over the client's batches,
    local-test accuracy before/after, weighted average), (b) fedskew's sequential executor,
(c) fedskew's vectorised executor, (d) Flower's simulation engine (when ``flwr`` is installed)
running the same client training inside a ClientApp with Flower's FedAvg strategy.

Every engine trains every client of the federation each round on the same batches (digits, pcdd,
E local epochs). Rounds of (a)-(c) are timed interleaved (a, b, c, a, b, c, ...) after one
warm-up round each, and the median is reported, so machine noise hits all engines alike. Flower is
timed per round from its own evaluate_fn timestamps, first round (actor start-up) dropped.

    python benchmarks/engine_speed.py                 # 10 and 100 clients, mlp and cnnbn
    python benchmarks/engine_speed.py --clients 100 --models mlp --no-flower
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from fedskew.config import load_config
from fedskew.engine.local import batch_schedule, federated_state
from fedskew.engine.runner import Experiment
from fedskew.methods.base import as_model_part


MODELS = {"mlp": ["model=mlp", "model.hidden=[64,64]"], "mlp200": ["model=mlp", "model.hidden=[200,200]"],
          "cnnbn": ["model=cnnbn", "model.width=16"], "tcnn": ["model=tcnn"]}


def make_cfg(clients: int, model: str, executor: str, epochs: int, batch: int):
    return load_config(None, [f"partition.num_clients={clients}", f"clients_per_round={clients}",
                              "partition.classes_per_client=3", *MODELS[model], f"local_epochs={epochs}",
                              f"batch_size={batch}", f"executor={executor}", "final_personalization=false"])


class Bare:
    """(a): what a user writes by hand with plain PyTorch."""

    def __init__(self, exp: Experiment):
        self.exp = exp
        self.model = exp.model
        self.state = federated_state(exp.model)
        self.settings = exp.executor.settings

    def local_acc(self, idx):
        self.model.eval()
        with torch.no_grad():
            acc = (self.model(self.exp.fed.data.x_train[idx]).argmax(1) == self.exp.fed.data.y_train[idx]).float().mean()
        self.model.train()
        return acc.item()

    def round(self, t: int):
        fed, s, model = self.exp.fed, self.settings, self.model
        x, y = fed.data.x_train, fed.data.y_train
        new, total = None, 0
        for k in range(fed.num_clients):
            model.load_state_dict(self.state, strict=False)
            self.local_acc(fed.test_idx[k])
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=s.momentum, weight_decay=s.weight_decay)
            idx = fed.train_idx[k]
            for pos in batch_schedule(s, t, k, len(idx)):
                rows = idx[torch.from_numpy(pos)]
                loss = F.cross_entropy(model(x[rows]), y[rows])
                opt.zero_grad()
                loss.backward()
                opt.step()
            self.local_acc(fed.test_idx[k])
            n = len(idx)
            trained = federated_state(model)
            new = {key: v * n for key, v in trained.items()} if new is None else \
                {key: new[key] + v * n for key, v in trained.items()}
            total += n
        self.state = {key: v / total for key, v in new.items()}


class Engine:
    """(b)/(c): one fedskew round through the executor and the method's aggregate."""

    def __init__(self, exp: Experiment):
        self.exp = exp
        self.state = federated_state(exp.model)

    def round(self, t: int):
        exp = self.exp
        clients = list(range(exp.fed.num_clients))
        results = exp.executor.train_round(t, clients, as_model_part(self.state), {k: {} for k in clients}, 0.01)
        self.state, _ = exp.method.aggregate({}, self.state, [r.upload for r in results], [r.report for r in results])


def flower_round_seconds(cfg, rounds: int) -> float | None:
    """(d): median seconds per round under flwr.simulation.run_simulation (Ray backend)."""
    try:
        from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
        from flwr.clientapp import ClientApp
        from flwr.serverapp import Grid, ServerApp
        from flwr.serverapp.strategy import FedAvg
        from flwr.simulation import run_simulation
    except ImportError:
        return None
    import logging

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
        res = _EXP.executor.train_client(int(msg.content["config"]["server-round"]), k, as_model_part(start), {}, 0.01)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--models", nargs="+", default=["mlp", "mlp200", "cnnbn"], choices=sorted(MODELS),
                        help="mlp: 64-64 MLP; mlp200: the default 200-200 MLP; cnnbn: small BN CNN (width 16)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per engine")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--no-flower", action="store_true")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; digits, pcdd (3 classes/client), "
          f"all clients every round, E={args.epochs}, B={args.batch}; median seconds per round")
    rows = []
    for model in args.models:
        for clients in args.clients:
            engines = {"bare": Bare(Experiment(make_cfg(clients, model, "sequential", args.epochs, args.batch))),
                       "sequential": Engine(Experiment(make_cfg(clients, model, "sequential", args.epochs, args.batch))),
                       "vectorized": Engine(Experiment(make_cfg(clients, model, "vectorized", args.epochs, args.batch)))}
            times = {name: [] for name in engines}
            for name, eng in engines.items():
                eng.round(0)  # warm-up
            for t in range(1, args.rounds + 1):
                for name, eng in engines.items():
                    t0 = time.perf_counter()
                    eng.round(t)
                    times[name].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            if not args.no_flower:
                med["flower"] = flower_round_seconds(make_cfg(clients, model, "sequential", args.epochs, args.batch),
                                                     args.rounds + 1)
            exp = engines["sequential"].exp
            steps = [len(batch_schedule(exp.executor.settings, 0, k, len(exp.fed.train_idx[k])))
                     for k in range(clients)]
            med["bound"] = sum(steps) / max(steps)  # best seq/vec possible: the longest client sets the pace
            rows.append((model, clients, med))
            line = "  ".join(f"{k} {v:.3f}s" for k, v in med.items() if v is not None and k != "bound")
            print(f"{model:6s} {clients:4d} clients: {line}", flush=True)
    print("\nratios (higher = the second engine is faster):")
    print(f"{'model':6s} {'clients':>7s} {'seq/bare':>9s} {'seq/vec':>9s} {'flower/vec':>11s} {'flower/seq':>11s}"
          f" {'bound':>6s}")
    for model, clients, m in rows:
        fl = m.get("flower")
        print(f"{model:6s} {clients:7d} {m['sequential'] / m['bare']:9.2f} {m['sequential'] / m['vectorized']:9.2f} "
              f"{(fl / m['vectorized']) if fl else float('nan'):11.2f} {(fl / m['sequential']) if fl else float('nan'):11.2f}"
              f" {m['bound']:6.2f}")
    print("bound = sum of client steps / steps of the longest client: the seq/vec ratio a vectorised "
          "program with zero overhead could reach, since it runs as many steps as the longest client.")


if __name__ == "__main__":
    main()
