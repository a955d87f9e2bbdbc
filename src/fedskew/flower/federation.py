"""Flower deployment: the app directory for ``flwr run``, the connection file, and
:class:`LocalFederation`, a real SuperLink and SuperNodes on this machine (tests, benchmarks).

Nothing here imports torch; the app directory's modules import :mod:`fedskew.flower.app` (the
ServerApp) and :mod:`fedskew.flower.client` (the torch-free ClientApp).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fedskew.engine.reaper import Reaper
from fedskew.flower.client import CONFIG_KEY, OUT_KEY, TIMEOUT_KEY, socket_path

if TYPE_CHECKING:
    from fedskew.config import RunConfig


# The app directory for ``flwr run``

PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedskew-app"
version = "1.0.0"
description = "A fedskew experiment as a Flower app"
license = "Apache-2.0"
# fedskew must be installed on the SuperLink and every SuperNode (runtime dependency
# installation stays off: it would pull a CUDA torch).
dependencies = []

[tool.flwr.app]
publisher = "fedskew"

[tool.flwr.app.components]
serverapp = "fedskew_server:server_app"
clientapp = "fedskew_client:client_app"

[tool.flwr.app.config]
{config}
"""


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string literal is a valid TOML basic string


def write_app(cfg: RunConfig, app_dir: str | Path, out_dir: str, timeout: float = 600.0,
              client: str = "worker") -> Path:
    """Write a Flower app directory running ``cfg``: pyproject.toml (components and run config)
    and two one-line modules exposing fedskew's ServerApp and a ClientApp (separate, so that a
    ClientApp process never imports the server side). ``client``: ``worker`` (default), the
    torch-free ClientApp with a resident worker; ``direct``, the in-process one (imports torch and
    builds data and model in every ClientApp process; for comparison)."""
    app_dir = Path(app_dir)
    app_dir.mkdir(parents=True, exist_ok=True)
    entries = {CONFIG_KEY: json.dumps(cfg.model_dump(mode="json"), sort_keys=True), OUT_KEY: str(out_dir)}
    lines = [f"{k} = {_toml_string(v)}" for k, v in entries.items()] + [f"{TIMEOUT_KEY} = {float(timeout)}"]
    (app_dir / "pyproject.toml").write_text(PYPROJECT.format(config="\n".join(lines)))
    (app_dir / "fedskew_server.py").write_text('"""fedskew\'s ServerApp."""\n\nimport fedskew.flower.app\n\n'
                                               "server_app = fedskew.flower.app.server_app\n")
    module = {"worker": "fedskew.flower.client", "direct": "fedskew.flower.app"}[client]
    (app_dir / "fedskew_client.py").write_text(f'"""fedskew\'s ClientApp ({client})."""\n\nimport {module}\n\n'
                                               f"client_app = {module}.client_app\n")
    return app_dir


def write_connection(flwr_home: str | Path, superlink: str, insecure: bool = True,
                     root_certificates: str | None = None, name: str = "fedskew") -> Path:
    """A Flower config (``$FLWR_HOME/config.toml``) with one SuperLink connection, the default."""
    home = Path(flwr_home)
    home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f'default = "{name}"', "", f"[superlink.{name}]", f"address = {_toml_string(superlink)}"]
    lines.append("insecure = true" if insecure else f"root-certificates = {_toml_string(str(root_certificates))}")
    (home / "config.toml").write_text("\n".join(lines) + "\n")
    return home / "config.toml"


# ---------------------------------------------------------------------------------------------
# A deployment on this machine


def flower_env(**extra: str) -> dict[str, str]:
    """The environment for Flower's processes: this interpreter's scripts folder first on PATH
    (the SuperLink and SuperNodes start ``flower-superexec``, ``flwr-clientapp``, ... by name),
    telemetry off."""
    import sys

    scripts = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": scripts + os.pathsep + os.environ.get("PATH", ""), "FLWR_TELEMETRY_ENABLED": "0",
            **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalFederation:
    """A real SuperLink and ``num_nodes`` SuperNodes on 127.0.0.1 (insecure), node k serving
    partition k, as separate processes; for tests and ``benchmarks/flower_overhead.py``.

    Every process starts in its own session and is stopped by process group (the SuperExec and
    the ``flwr-clientapp``/``flwr-serverapp`` processes it spawns included); the resident workers,
    which run detached, are stopped by the PID files they write in ``workdir/workers``. ``stop``
    runs on exit of the ``with`` block, also after an error; if the process that started the
    federation dies without ``stop`` (SIGKILL, a crash), a :class:`~fedskew.engine.reaper.Reaper`
    kills every one of them (workers included)."""

    def __init__(self, num_nodes: int, workdir: str | Path, poll_interval: float | None = None):
        self.num_nodes = num_nodes
        self.workdir = Path(workdir)
        self.port = free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        self.reaper: Reaper | None = None
        self.env = flower_env(FEDSKEW_WORKER_DIR=str(self.workdir / "workers"),
                              FLWR_HOME=str(self.workdir / "flwr-home"))
        if poll_interval is not None:  # SuperExec's task poll (default 1 s)
            self.env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = str(poll_interval)

    def _start(self, name: str, cmd: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        self.reaper.watch(self.procs[name].pid, group=True)

    def start(self) -> LocalFederation:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.reaper = Reaper(pid_dirs=(self.workdir / "workers",))
        write_connection(self.workdir / "flwr-home", f"127.0.0.1:{self.port}")
        self._start("superlink", ["flower-superlink", "--insecure", "--disable-runtime-dependency-installation",
                                  "--host", "127.0.0.1", "--port", str(self.port),
                                  "--database", str(self.workdir / "superlink.db")])
        self._wait_port(self.port)
        for k in range(self.num_nodes):
            self._start(f"supernode{k}", ["flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{self.port}",
                                          "--node-config", f"partition-id={k} num-partitions={self.num_nodes}",
                                          "--host", "127.0.0.1", "--port", str(free_port())])
        return self

    def _wait_port(self, port: int, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            if self.procs["superlink"].poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(
            f"the SuperLink did not start listening on 127.0.0.1:{port}; see {self.workdir}/superlink.log"
        )

    def run(self, cfg: RunConfig, out_dir: str | Path, timeout: float = 600.0, wait: bool = True,
            client: str = "worker"):
        """``flwr run`` of ``cfg`` (its ServerApp writes ``out_dir``); the Popen when not ``wait``."""
        app = write_app(cfg, self.workdir / "app", str(Path(out_dir).resolve()), timeout, client)
        log = open(self.workdir / "flwr-run.log", "ab")
        proc = subprocess.Popen(["flwr", "run", str(app), "fedskew", "--stream"], stdout=log, stderr=subprocess.STDOUT,
                                env=self.env, start_new_session=True)
        self.reaper.watch(proc.pid, group=True)
        self.procs[f"flwr-run-{len(self.procs)}"] = proc
        if wait:
            proc.wait()
        return proc

    def kill_node(self, k: int) -> None:
        """SIGKILL SuperNode k, its ClientApp processes and its resident worker."""
        self._kill(self.procs.pop(f"supernode{k}"))
        for pidfile in (self.workdir / "workers").glob(f"p{k}-*.pid"):
            self._kill_pid(int(pidfile.read_text()))
            socket_path(pidfile.parent, pidfile.stem).unlink(missing_ok=True)
            pidfile.unlink(missing_ok=True)

    @staticmethod
    def _kill(proc) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    @staticmethod
    def _kill_pid(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def pids(self) -> list[int]:
        """Every process this federation started that is still alive (workers included)."""
        alive = [p.pid for p in self.procs.values() if p.poll() is None]
        for pidfile in (self.workdir / "workers").glob("*.pid"):
            try:
                pid = int(pidfile.read_text())
                os.kill(pid, 0)
                alive.append(pid)
            except (OSError, ValueError):
                pass
        return alive

    def stop(self) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.time()))
            except Exception:  # still alive after the grace period
                self._kill(proc)
            else:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # children that outlived their parent
                except ProcessLookupError:
                    pass
        for pidfile in (self.workdir / "workers").glob("*.pid"):
            try:
                self._kill_pid(int(pidfile.read_text()))
            except ValueError:
                pass
            socket_path(pidfile.parent, pidfile.stem).unlink(missing_ok=True)
        self.procs.clear()
        if self.reaper is not None:
            self.reaper.close()
            self.reaper = None

    def __enter__(self) -> LocalFederation:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()



__all__ = ["LocalFederation", "flower_env", "free_port", "write_app", "write_connection"]
