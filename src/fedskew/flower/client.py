"""The deployment ClientApp: torch-free, it forwards each message to a resident worker.

Flower 1.41 starts a fresh ``flwr-clientapp`` process for every message, in both SuperNode
isolation modes, so a ClientApp that imports torch and rebuilds the data split and the model pays
that (about 4.4 s here) on every round. This module imports only Flower, numpy and the standard
library. On its first message it starts ``python -m fedskew.flower.worker`` for the node's
(config, partition): a process that keeps torch, the data and the model loaded and trains
clients on request over a local socket (``multiprocessing.connection``, AF_UNIX, with a random
authentication key in a 0600 file); later messages only connect. The worker holds no client
state: the client state travels in Flower's ``context.state`` as before, and the worker exits
after ``FEDSKEW_WORKER_IDLE`` seconds (default 900) without requests.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Client
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

CONFIG_KEY = "fedskew-config"  # run-config keys of the Flower app (fedskew.flower.federation.write_app)
OUT_KEY = "out-dir"
TIMEOUT_KEY = "timeout"
STATE_KEY = "fedskew.client_state"


def numpy_of(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: record[k].numpy() for k in record.keys()}


def record_of(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


# An AF_UNIX socket's path holds at most 107 bytes (Linux; 103 on macOS), and the worker binds
# "<socket>.tmp" first: a socket whose path would be longer lives alone in a short folder.
SOCKET_PATH_MAX = 100


def worker_paths(cfg_json: str, partition: int) -> tuple[Path, Path, Path]:
    """(socket, key file, config file) of the worker for this config and partition, in
    ``$FEDSKEW_WORKER_DIR`` (default: a per-user folder in the temp directory); the worker writes
    its PID beside the key file (``.pid``). In a folder so deep that the socket's path would pass
    :data:`SOCKET_PATH_MAX` bytes, the socket goes to a per-user folder in the temp directory."""
    folder = Path(os.environ.get("FEDSKEW_WORKER_DIR") or Path(tempfile.gettempdir()) / f"fedskew-flower-{os.getuid()}")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    tag = f"p{partition}-" + hashlib.sha1(cfg_json.encode()).hexdigest()[:16]
    return socket_path(folder, tag), folder / f"{tag}.key", folder / f"{tag}.json"


def socket_path(folder: Path, tag: str) -> Path:
    """The socket of worker ``tag`` of ``folder`` (:func:`worker_paths`)."""
    sock = folder / f"{tag}.sock"
    if len(os.fsencode(sock)) + len(".tmp") > SOCKET_PATH_MAX:
        short = Path(tempfile.gettempdir()) / f"fedskew-sock-{os.getuid()}"
        short.mkdir(mode=0o700, exist_ok=True)
        sock = short / f"{hashlib.sha1(os.fsencode(folder)).hexdigest()[:8]}-{tag}.sock"
    return sock


def _connect(cfg_json: str, partition: int, start_timeout: float = 120.0):
    sock, keyfile, cfgfile = worker_paths(cfg_json, partition)
    if sock.exists() and keyfile.exists():
        try:
            return Client(str(sock), family="AF_UNIX", authkey=keyfile.read_bytes())
        except (OSError, EOFError):  # a stale socket of a worker that exited
            sock.unlink(missing_ok=True)
    key = secrets.token_bytes(32)
    fd = os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key)
    cfgfile.write_text(cfg_json)
    subprocess.Popen([sys.executable, "-m", "fedskew.flower.worker", str(sock), str(keyfile), str(cfgfile)],
                     stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + start_timeout
    while time.time() < deadline:
        if sock.exists():
            try:
                return Client(str(sock), family="AF_UNIX", authkey=key)
            except (OSError, EOFError):
                pass
        time.sleep(0.05)
    raise RuntimeError(f"the fedskew worker for partition {partition} did not start within {start_timeout:.0f} s")


def client_train(msg: Message, context: Context) -> Message:
    conf = msg.content["config"]
    k = int(conf["client"])
    served = context.node_config.get("partition-id")
    if served is not None and int(served) != k:
        raise ValueError(f"this SuperNode serves partition {served}, but the server sent client {k}")
    state = numpy_of(context.state[STATE_KEY]) if STATE_KEY in context.state else None
    download = numpy_of(msg.content["download"]) if "download" in msg.content else None
    conn = _connect(str(conf[CONFIG_KEY]), k)
    try:
        conn.send(("train", k, int(conf["round"]), float(conf["lr"]), numpy_of(msg.content["payload"]), state,
                   download))
        status, *reply = conn.recv()
    finally:
        conn.close()
    if status != "ok":
        raise RuntimeError(reply[0])
    upload, new_state, report = reply
    if bool(conf["keep-state"]):
        context.state[STATE_KEY] = record_of(new_state)
    return Message(RecordDict({"upload": record_of(upload), "report": MetricRecord(report)}), reply_to=msg)


def client_query(msg: Message, context: Context) -> Message:
    served = context.node_config.get("partition-id", -1)
    return Message(RecordDict({"node": ConfigRecord({"partition-id": int(served)})}), reply_to=msg)


client_app = ClientApp()
client_app.train()(client_train)
client_app.query()(client_query)
