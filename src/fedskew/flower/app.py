"""Flower runtime: any fedskew method and config as a Flower app (Message API: ServerApp,
ClientApp, SuperLink and SuperNodes). ``flwr`` is an optional extra (``pip install
fedskew[flower]``); only the CLI's ``fedskew flower`` and :mod:`fedskew.flower.worker` import
this module.

Mapping. The ServerApp runs fedskew's own round loop (:class:`~fedskew.engine.runner.Experiment`,
so the records, checkpoints of global and server state, metrics and summary are those of
``fedskew run``) with a :class:`FlowerExecutor` in place of the local executors: each selected
client becomes one ``train`` message to the SuperNode serving that client's partition, carrying

* ``payload``: an ArrayRecord holding ``Method.broadcast``'s dict one-to-one (same keys);
* ``download`` (only for a method with per-client downloads): an ArrayRecord holding that
  client's ``Method.download`` (FedFOMO's chosen models, pFedHN's generated model, FedAMP's cloud
  model, FedFed's shared samples), merged into the client's state on the node for the round;
* ``config``: a ConfigRecord with the round, the learning rate, the client id, whether to keep the
  client state, and the resolved fedskew config (JSON) so the node builds the same data split,
  model and method.

The ClientApp trains with fedskew's sequential executor (``train_client``: the same code as
``fedskew run``), and replies with ``upload`` (an ArrayRecord holding ``after_training``'s upload
one-to-one) and ``report`` (a MetricRecord: samples, steps, lr, momentum, loss, local accuracies,
aux values). The client's persistent state (HPM, control variates, ...) is an ArrayRecord in
Flower's per-node ``context.state``. Which partition a SuperNode serves comes from its node config
(``partition-id``; the simulation runtime sets it per node). Built-in Flower strategies are not
used: they accept one ArrayRecord per reply and know nothing of server state.

Failures. A client whose node does not answer within ``timeout`` seconds (a node's first training message waits at least
``COLD_START_S``: its ClientApp may still be importing torch on a loaded machine), or whose ClientApp raises, is
reported in the round's ``clients_failed`` and left out of the aggregation, as in ``fedskew run``; a round where every
client fails stops the run.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from pathlib import Path

from fedskew.algorithms.base import ClientReport
from fedskew.config import ConfigError, RunConfig, validate_config
from fedskew.engine.protocol import ClientResult, Executor

try:
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
except ImportError as exc:  # pragma: no cover - exercised where flwr is absent
    raise ImportError("fedskew's Flower runtime needs flwr; install it with `pip install fedskew[flower]`.") from exc

from fedskew.flower.client import CONFIG_KEY, OUT_KEY, STATE_KEY, TIMEOUT_KEY, client_query  # noqa: E402


def check_supported(cfg: RunConfig) -> None:
    """One sentence for a config the Flower runtime cannot run."""
    if cfg.distributed:
        raise ConfigError("distributed = true spreads a run's clients over torchrun ranks; on Flower each SuperNode "
                          "already trains its own clients: leave it false.")


def to_record(state: dict) -> ArrayRecord:
    """A flat dict of tensors as an ArrayRecord, key for key (CPU, contiguous)."""
    return ArrayRecord(OrderedDict((k, v.detach().cpu().contiguous()) for k, v in state.items()))


def from_record(record: ArrayRecord) -> dict:
    return dict(record.to_torch_state_dict())


# ---------------------------------------------------------------------------------------------
# Client side


class _NodeRuntime:
    """What a node needs to train its client: data, model, method, the sequential executor, and
    the initial model state (for ``client_init``). Built once per process and config."""

    def __init__(self, cfg: RunConfig):
        from fedskew.engine.local import federated_state
        from fedskew.engine.runner import Experiment

        self.exp = Experiment(cfg)
        self.executor = self.exp.executor.sequential  # one client per message
        self.initial = federated_state(self.exp.model)

    def train(self, k: int, round_idx: int, lr: float, payload: dict, client_state: dict | None,
              download: dict | None = None) -> ClientResult:
        """Client k's local round (its state from ``client_init`` on a first visit), its own
        ``Method.download`` merged into its state for the round, as ``dispatch`` does locally."""
        if client_state is None:
            client_state = self.exp.method.client_init(k, self.initial, self.exp.info)
        return self.executor.train_client(round_idx, k, payload, {**client_state, **(download or {})}, lr)


_RUNTIMES: dict[str, _NodeRuntime] = {}


def _runtime(cfg_json: str) -> _NodeRuntime:
    if cfg_json not in _RUNTIMES:
        _RUNTIMES.clear()
        _RUNTIMES[cfg_json] = _NodeRuntime(validate_config(json.loads(cfg_json)))
    return _RUNTIMES[cfg_json]


def client_train(msg: Message, context: Context) -> Message:
    """One client's local round (the ClientApp's ``train`` handler)."""
    conf = msg.content["config"]
    rt = _runtime(str(conf[CONFIG_KEY]))
    k = int(conf["client"])
    served = context.node_config.get("partition-id")
    if served is not None and int(served) != k:
        raise ValueError(f"this SuperNode serves partition {served}, but the server sent client {k}")
    state = from_record(context.state[STATE_KEY]) if STATE_KEY in context.state else None
    download = from_record(msg.content["download"]) if "download" in msg.content else None
    result = rt.train(k, int(conf["round"]), float(conf["lr"]), from_record(msg.content["payload"]), state, download)
    if bool(conf["keep-state"]):
        context.state[STATE_KEY] = to_record(result.client_state)
    return Message(RecordDict({"upload": to_record(result.upload), "report": MetricRecord(report_of(result))}),
                   reply_to=msg)


def report_of(result: ClientResult) -> dict:
    """The MetricRecord content of a client's reply (local accuracies only when defined)."""
    report = {"num_samples": result.report.num_samples, "num_steps": result.report.num_steps,
              "lr": result.report.lr, "momentum": result.report.momentum, "train_loss": result.train_loss}
    report.update({k: v for k, v in (("acc_before", result.acc_before), ("acc_after", result.acc_after))
                   if v is not None})
    report.update({"aux." + k: float(v) for k, v in result.aux.items()})
    return report


def make_client_app() -> ClientApp:
    """The in-process ClientApp (simulation runtime: its actors are long-lived processes). For
    deployment, :mod:`fedskew.flower.client` is the torch-free ClientApp with a resident worker."""
    app = ClientApp()
    app.train()(client_train)
    app.query()(client_query)
    return app


# ---------------------------------------------------------------------------------------------
# Server side


COLD_START_S = 300.0  # the least wait for a node's first training reply (imports, first data decode)


class FlowerExecutor(Executor):
    """An executor whose clients are SuperNodes: one message per selected client, replies turned
    back into :class:`ClientResult` (client state stays on the node). ``failed`` lists the
    clients of the last round that did not answer or raised."""

    name = "flower"
    remote_states = True  # client states live on the nodes: the runner passes the downloads apart

    def __init__(self, grid: Grid, cfg: RunConfig, timeout: float = 600.0, wait_for_nodes: float = 120.0):
        self.grid = grid
        self.cfg_json = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
        self.timeout = timeout
        self.failed: list[dict] = []
        self.answered: set[int] = set()  # nodes that replied to a training message: past their cold start
        self.node_of = self._discover(cfg.partition.num_clients, wait_for_nodes)

    def _discover(self, num_clients: int, wait: float) -> dict[int, int]:
        """Partition id -> node id, asking each connected node which partition it serves."""
        deadline = time.time() + wait
        nodes = list(self.grid.get_node_ids())
        while len(nodes) < num_clients and time.time() < deadline:
            time.sleep(0.5)
            nodes = list(self.grid.get_node_ids())
        asks = [Message(RecordDict({"q": ConfigRecord({"what": "partition-id"})}), dst_node_id=n,
                        message_type="query") for n in nodes]
        node_of = {}
        for reply in self._exchange(asks, timeout=wait)[1].values():
            if not reply.has_error():
                pid = int(reply.content["node"]["partition-id"])
                node_of[pid if pid >= 0 else len(node_of)] = reply.metadata.src_node_id
        missing = sorted(set(range(num_clients)) - set(node_of))
        if missing:
            raise ConfigError(f"partition.num_clients = {num_clients}, but no SuperNode serves partitions "
                              f"{missing[:10]} (connected: {len(nodes)}); start one SuperNode per partition with "
                              f"--node-config 'partition-id=<k>'.")
        return node_of

    def _exchange(self, messages: list[Message], timeout: float | None = None,
                  poll: float = 0.05) -> tuple[list[str], dict[str, Message]]:
        """Push ``messages`` and pull their replies every ``poll`` seconds until all arrived or
        ``timeout`` passed (``Grid.send_and_receive`` sleeps 3 s between pulls, which adds up to
        3 s to every round). Returns the message ids in order and the replies by message id
        (a reply may be an error Flower itself sends, e.g. for a node that went away)."""
        ids = list(self.grid.push_messages(messages))
        pending = set(ids)
        deadline = time.time() + (self.timeout if timeout is None else timeout)
        replies: dict[str, Message] = {}
        while pending and time.time() < deadline:
            for m in self.grid.pull_messages(pending):
                replies[m.metadata.reply_to_message_id] = m
            pending -= set(replies)
            if pending:
                time.sleep(poll)
        return ids, replies

    def train_round(self, round_idx: int, clients: list[int], payload: dict, client_states: dict,
                    lr: float, keep_state: bool = True, downloads: dict | None = None) -> list[ClientResult]:
        """One message per selected client: the payload, its own download (``Method.download``:
        FedFOMO's models, FedFed's shared samples) when it has one, and the round's config."""
        record = to_record(payload)
        messages, sent = [], {}
        alive = set(self.grid.get_node_ids())
        self.failed = []
        for k in clients:
            node = self.node_of[k]
            if node not in alive:
                self.failed.append({"client": k, "error": "its SuperNode is not connected"})
                continue
            conf = ConfigRecord({CONFIG_KEY: self.cfg_json, "round": round_idx, "lr": float(lr), "client": k,
                                 "keep-state": keep_state})
            content = {"payload": record, "config": conf}
            if downloads and downloads.get(k):
                content["download"] = to_record(downloads[k])
            messages.append(Message(RecordDict(content), dst_node_id=node, message_type="train"))
            sent[node] = k
        wait = self.timeout if set(sent) <= self.answered else max(self.timeout, COLD_START_S)
        ids, by_id = self._exchange(messages, timeout=wait)
        replies = {}
        for msg_id, (node, k) in zip(ids, sent.items()):
            reply = by_id.get(msg_id)
            if reply is None:
                self.failed.append({"client": k, "error": f"no reply within {wait:.0f} s"})
            elif reply.has_error():
                self.failed.append(
                    {"client": k, "error": f"Flower error {reply.error.code}: {reply.error.reason[:200]}"}
                )
            else:
                replies[k] = reply
                self.answered.add(node)
        for f in self.failed:
            print(f"fedskew: round {round_idx}: client {f['client']} failed and is left out of the aggregation "
                  f"({f['error']})", flush=True)
        results = []
        for k in clients:  # in selection order, as the local executors return them
            if k not in replies:
                continue
            rep = dict(replies[k].content["report"])
            report = ClientReport(k, int(rep["num_samples"]), int(rep["num_steps"]), float(rep["lr"]),
                                  float(rep["momentum"]))
            aux = {key[4:]: float(v) for key, v in rep.items() if key.startswith("aux.")}
            results.append(ClientResult(k, from_record(replies[k].content["upload"]), {}, report,
                                        float(rep["train_loss"]), rep.get("acc_before"), rep.get("acc_after"), aux))
        if not results:
            from fedskew.engine.runner import ClientFailure

            raise ClientFailure(f"round {round_idx}: no selected client answered; the first error was "
                                f"{self.failed[0]['error'] if self.failed else 'none'}")
        return results


def server_main(grid: Grid, context: Context, cfg_json: str | None = None, out_dir: str | None = None,
                timeout: float | None = None) -> dict:
    """The ServerApp: fedskew's round loop over Flower messages; writes the usual run directory."""
    from fedskew.engine.runner import Experiment

    cfg_json = cfg_json or str(context.run_config[CONFIG_KEY])
    out_dir = out_dir or str(context.run_config.get(OUT_KEY, "runs/flower"))
    timeout = float(timeout or context.run_config.get(TIMEOUT_KEY, 600.0))
    cfg = validate_config(json.loads(cfg_json))
    check_supported(cfg)
    exp = Experiment(cfg, Path(out_dir))
    exp.executor = FlowerExecutor(grid, cfg, timeout)
    return exp.run().summary


def make_server_app(cfg: RunConfig | None = None, out_dir: str | None = None, timeout: float | None = None,
                    done: list | None = None) -> ServerApp:
    """A ServerApp for ``cfg`` (None: read from the run config, as under ``flwr run``); the summary
    is appended to ``done`` when given."""
    cfg_json = json.dumps(cfg.model_dump(mode="json"), sort_keys=True) if cfg is not None else None
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        summary = server_main(grid, context, cfg_json, out_dir, timeout)
        if done is not None:
            done.append(summary)

    return app


# Module-level apps for ``flwr run`` (the app directory's modules re-export them).
client_app = make_client_app()
server_app = make_server_app()


def simulate(cfg: RunConfig, out_dir: str | Path, verbose: bool = False) -> dict:
    """Run ``cfg`` on Flower's simulation runtime, one SuperNode per client; the summary."""
    import logging

    from flwr.simulation import run_simulation

    check_supported(cfg)
    if not verbose:
        logging.getLogger("flwr").setLevel(logging.WARNING)
    done: list = []
    run_simulation(server_app=make_server_app(cfg, str(out_dir), done=done), client_app=make_client_app(),
                   num_supernodes=cfg.partition.num_clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}}, verbose_logging=verbose)
    if not done:
        raise RuntimeError(f"the Flower simulation ended without a result; see the log above and {out_dir}.")
    return done[0]


__all__ = [
    "FlowerExecutor",
    "check_supported",
    "client_app",
    "from_record",
    "make_client_app",
    "make_server_app",
    "server_app",
    "simulate",
    "to_record",
]
