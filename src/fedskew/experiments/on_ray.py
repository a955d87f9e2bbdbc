"""A sweep's runs as Ray tasks: ``fedskew sweep FILE --ray [ADDRESS]`` (docs/scaling.md).

The sweep process stays the driver and the only writer of ``results.sqlite``: it submits each
pending run as a task asking for ``resources`` (``num_cpus``, ``num_gpus``; GPU fractions share a
device), keeps at most as many in flight as the cluster can hold at once (so "running" in the
progress line means running), and records each result as it comes back. A task runs the same
function ``--jobs`` workers run (:func:`fedskew.experiments.pool.execute_run`): a run directory that
already holds a checkpoint is resumed, so a task lost with its node is retried by Ray (up to
``MAX_RETRIES`` times) and continues from the run's last checkpoint, and a sweep started again
skips finished runs and resumes interrupted ones. This needs the sweep folder and the data at the
same paths on every node (a shared filesystem); tasks run in the driver's working directory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from fedskew.config import ConfigError

MAX_RETRIES = 3  # Ray's resubmissions of a task whose worker process or node died
LOCK_WAIT_S = 120.0  # a retried run waits this long for the lost attempt's process to let go of its folder


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'fedskew[flower]' (or pip install 'ray[default]').") from None
    return ray


def _task(config: dict, run_dir: str, cwd: str, external: dict, threads: int):
    """One run on a Ray worker: the driver's working directory, ``threads`` torch threads, the
    methods registered from outside the package; then the same entry point as a ``--jobs`` worker."""
    import torch

    from fedskew.algorithms import import_methods
    from fedskew.engine.durable import FolderLock
    from fedskew.experiments.pool import execute_run

    torch.set_num_threads(threads)
    import_methods(external)
    if os.path.isdir(cwd):
        os.chdir(cwd)
    folder = Path(run_dir)
    deadline = time.monotonic() + LOCK_WAIT_S
    while folder.is_dir():  # a retry after a lost node: the dying attempt may still hold the folder
        try:
            FolderLock(folder, "run directory").acquire().release()
            break
        except ConfigError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    return execute_run(config, run_dir)


def check_address(address: str) -> None:
    """A host:port (or ray://host:port) that does not accept a connection within 5 s is one
    sentence now, instead of Ray's minutes of reconnecting."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if address in ("local", "auto") or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise ConfigError(f"no Ray cluster answers at '{address}' ({exc.strerror or exc}); start one with `ray start "
                          f"--head` and pass the address it prints, or --ray alone for a local instance.") from None


def run_on_ray(todo: list[dict], run_dir: dict[str, str], address: str, resources,
               started: Callable[[dict], None], finished: Callable) -> None:
    """Run ``todo`` on Ray at ``address`` ("local": a new local instance), reporting each run to
    ``started`` and ``finished`` (the sweep's database writers) in the driver."""
    ray = _ray()
    from fedskew.algorithms import external_methods
    from fedskew.experiments.pool import interactive_methods

    external = external_methods()
    if interactive_methods(external):
        raise ConfigError("methods registered in an interactive session cannot be sent to Ray workers; define them in "
                          "a module the workers can import (fedskew.register_method in a .py file).")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"ray\..*")  # (accelerator env var notice)
    try:
        if address == "local":  # (address="local": a new instance, never a stale `ray start` one)
            ray.init(address="local", include_dashboard=False, log_to_driver=False, logging_level="WARNING")
        else:
            ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"cannot reach a Ray cluster at '{address}' ({(str(exc).splitlines() or [''])[0][:200]}); "
                          f"start one with `ray start --head` or pass its address (auto, host:port, "
                          f"ray://host:10001).") from None
    task = ray.remote(num_cpus=resources.num_cpus, num_gpus=resources.num_gpus, max_retries=MAX_RETRIES,
                      retry_exceptions=False)(_task)
    threads = max(1, int(resources.num_cpus))
    cwd = os.getcwd()

    def capacity() -> int:
        total = ray.cluster_resources()
        slots = int(total.get("CPU", 0) // resources.num_cpus)
        if resources.num_gpus:
            slots = min(slots, int(total.get("GPU", 0) // resources.num_gpus))
        return max(1, slots)

    queue, in_flight = list(todo), {}
    try:
        while queue or in_flight:
            while queue and len(in_flight) < capacity():
                r = queue.pop(0)
                in_flight[task.remote(r["config"], run_dir[r["run_id"]], cwd, external, threads)] = r
                started(r)
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=5.0)
            for ref in ready:
                r = in_flight.pop(ref)
                try:
                    summary, history, env = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:  # the run itself raised: recorded, the others go on
                    cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                    finished(r, None, None, f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:300]}")
                    continue
                except ray.exceptions.RayError as exc:  # lost MAX_RETRIES + 1 times with its worker or node
                    finished(r, None, None, f"its Ray task was lost {MAX_RETRIES + 1} times ({type(exc).__name__}); "
                                            f"the same sweep command again resumes it from its checkpoint")
                    continue
                finished(r, summary, history, env=env)
    except BaseException:  # Ctrl-C: stop the tasks now; their runs resume from checkpoints next time
        for ref in in_flight:
            ray.cancel(ref, force=True)
        raise
    finally:
        ray.shutdown()


__all__ = ["MAX_RETRIES", "check_address", "run_on_ray"]
