"""Where a sweep's runs execute: one run or one pack of runs (the worker entry points, also Ray's),
the packing of runs into lanes (:mod:`fedskew.engine.lanes`), and the pool of worker processes for
``--jobs`` > 1 (:class:`WorkerPool`): one torch thread each, a worker dying with the sweep process,
a run that killed its worker run again alone, SIGTERM/SIGINT forwarded as "stop after this round".

The sweep process (:mod:`fedskew.experiments.sweep`) hands units of work (lists of runs) to
:func:`run_in_process` or :class:`WorkerPool` with a recorder that writes the results store; this
module never touches the database.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from fedskew.config import RECORD_KEYS, ConfigError, validate_config
from fedskew.engine.durable import RunInterrupted
from fedskew.experiments.store import scalar_metrics

# After SIGTERM or SIGINT, how long the sweep waits for its workers' runs to reach a round boundary
# and checkpoint; a run still in its round then is stopped and resumes from its last checkpoint.
STOP_GRACE_S = 60.0

_ROUNDS = None  # in a worker: the queue on which it tells the sweep process (run_id, rounds done, rounds)


def releases_device_memory(entry: Callable) -> Callable:
    """A worker entry point that, once its runs' tensors are gone, hands the CUDA caching
    allocator's free blocks back to the device. Several workers share one GPU: an idle worker
    kept what its last pack had cached (33 GiB each, seen on an H200), and the next pack in another
    worker ran out of memory however few lanes it stacked."""

    @functools.wraps(entry)
    def entry_point(*args, **kwargs):
        try:
            return entry(*args, **kwargs)
        finally:
            import torch

            if torch.cuda.is_initialized():
                gc.collect()  # (a run's model and optimiser may sit in reference cycles)
                torch.cuda.empty_cache()
    return entry_point


@releases_device_memory
def execute_run(config: dict, run_dir: str, report: Callable[[tuple], None] | None = None) -> tuple[dict, list[dict]]:
    """Run (or resume, when its directory already holds one) a single run; worker entry point.
    After each round, ``report`` (in a worker: its queue to the sweep) gets (run_id, rounds done,
    rounds)."""
    from fedskew.engine.runner import Experiment

    run_dir_p = Path(run_dir)
    cfg = validate_config({k: v for k, v in config.items() if k not in RECORD_KEYS})
    resume = (run_dir_p / "config.yaml").is_file()
    report = report or (_ROUNDS.put if _ROUNDS is not None else None)
    on_round = None if report is None else lambda record: report((run_dir_p.name, record["round"] + 1, cfg.rounds))
    result = Experiment(cfg, run_dir_p, resume=resume).run(on_round)
    return result.summary, [scalar_metrics(h) for h in result.history], result.environment


# Run config keys in which the runs of one pack may differ (fedskew.engine.lanes), besides the
# method's float options: everything else shapes the stacked step and must be equal.
LANE_FREE = frozenset({"seed", "lr", "lr_decay", "lr_decay_every", "lr_schedule", "lr_min", "partition", "rounds",
                       "clients_per_round", "eval_every",
                       "checkpoint_every", "run_name", "out_dir", "logger", "logger_group", "fail_fast",
                       "feature_stats", "classifier_stats", "forgetting_stats", "forgetting_test_samples",
                       "final_personalization", *RECORD_KEYS})


def pack_key(config: dict) -> str | None:
    """Runs with one key may train as lanes of one pack; None: this run trains alone (not on the
    vectorised executor, or spread over torchrun ranks)."""
    if config.get("executor") != "vectorized" or config.get("distributed"):
        return None

    def shape(v):  # a float option's value does not shape the step
        return {k: shape(x) for k, x in v.items()} if isinstance(v, dict) else "float" if isinstance(v, float) else v
    return json.dumps({k: shape(v) if k == "method" else v for k, v in config.items() if k not in LANE_FREE},
                      sort_keys=True, default=str)


def pack_size(pack: str | int, config: dict) -> int:
    """How many runs like ``config`` one pack takes: ``off`` 1, N N; ``auto``: 32 on a CUDA device,
    1 on the CPU (where ``--jobs`` runs whole runs side by side instead)."""
    if pack == "off":
        return 1
    if pack == "auto":
        return AUTO_PACK if str(config.get("device", "cpu")).startswith("cuda") else 1
    return int(pack)


AUTO_PACK = 32


def check_pack(value) -> str | int:
    """``--pack``'s value: ``auto``, ``off`` or a positive integer, else one sentence."""
    text = str(value).strip().lower()
    if text in ("auto", "off"):
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ConfigError(f"pack = '{value}' is not allowed; give auto, off or a positive integer (runs per pack).")


def packs(todo: list[dict], pack: str | int) -> list[list[dict]]:
    """``todo`` as units of work: lists of runs that train as one pack (a run that cannot pack, or
    with ``pack`` off, is a unit alone), in the order of their first run."""
    units: list[list[dict]] = []
    open_unit: dict[str, list[dict]] = {}
    for r in todo:
        key, size = pack_key(r["config"]), pack_size(pack, r["config"])
        unit = open_unit.get(key) if key is not None and size > 1 else None
        if unit is None or len(unit) >= size:
            unit = []
            units.append(unit)
            if key is not None and size > 1:
                open_unit[key] = unit
        unit.append(r)
    return units


@releases_device_memory
def execute_pack(configs: list[dict], run_dirs: list[str], report: Callable[[tuple], None] | None = None) -> list:
    """Run (or resume) several runs as lanes of one pack (:mod:`fedskew.engine.lanes`); worker entry
    point. One outcome per run: ``("done", summary, history, environment)``, ``("failed", error
    text)`` or ``("interrupted", message)``; a run's failure leaves the others running."""
    from fedskew.engine.lanes import Pack
    from fedskew.engine.runner import Experiment

    report = report or (_ROUNDS.put if _ROUNDS is not None else None)
    pack, experiments, callbacks, outcomes = Pack(), [], [], [None] * len(configs)
    for i, (config, run_dir) in enumerate(zip(configs, run_dirs)):
        run_dir_p = Path(run_dir)
        try:
            cfg = validate_config({k: v for k, v in config.items() if k not in RECORD_KEYS})
            experiments.append((i, Experiment(cfg, run_dir_p, resume=(run_dir_p / "config.yaml").is_file(), pack=pack)))
        except Exception as exc:
            outcomes[i] = ("failed", error_text(exc))
            continue
        callbacks.append(None if report is None else
                         (lambda record, name=run_dir_p.name, n=cfg.rounds: report((name, record["round"] + 1, n))))
    results = pack.run([e for _, e in experiments], callbacks)
    for (i, _), result in zip(experiments, results):
        if isinstance(result, RunInterrupted):
            outcomes[i] = ("interrupted", str(result))
        elif isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result
            outcomes[i] = ("failed", error_text(result))
        else:
            outcomes[i] = ("done", result.summary, [scalar_metrics(h) for h in result.history], result.environment)
    return outcomes


def check_data(runs: list[dict]) -> None:
    """Load every data set the sweep needs once, before anything is planned into the database: a
    missing or corrupt data set is one error, not one failed run per grid point and seed."""
    from fedskew.config import DatasetConfig
    from fedskew.data import load_dataset

    seen = set()
    for r in runs:
        key = json.dumps(r["config"]["dataset"], sort_keys=True)
        if key not in seen and r["config"]["dataset"]["name"] not in ("digits", "synthetic"):
            seen.add(key)
            load_dataset(DatasetConfig.model_validate(r["config"]["dataset"]), r["seed"])


def worker_init(external: dict[str, tuple[str, str]], parent: int, rounds=None, jobs: int = 1) -> None:
    """A sweep worker: it dies with the sweep process ``parent``, stops its run after the current
    round on SIGTERM or SIGINT (the sweep forwards them), reports each round on ``rounds``, one
    torch thread, the methods registered from outside the package, and a 1 / ``jobs`` share of a
    CUDA device's memory to size its stacked chunks from (:data:`fedskew.engine.memory.DEVICE_SHARE`)."""
    global _ROUNDS
    _ROUNDS = rounds
    from fedskew.engine import memory

    memory.DEVICE_SHARE = 1.0 / max(1, jobs)

    from fedskew.engine.durable import stop_after_this_round

    _die_with_parent(parent)
    signal.signal(signal.SIGTERM, stop_after_this_round)
    signal.signal(signal.SIGINT, stop_after_this_round)
    import gc

    import torch

    from fedskew.algorithms import import_methods

    gc.freeze()  # (torch's objects, alive as long as the worker: as the command line does, see fedskew.cli)
    torch.set_num_threads(1)
    import_methods(external)


def _die_with_parent(parent: int) -> None:
    """A worker whose sweep process died (SIGKILL, a crash; even while this worker was starting)
    exits at once instead of finishing its run and writing a directory the next sweep will write
    too."""
    import threading

    if os.getppid() != parent:
        os._exit(1)

    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="fedskew-parent-watch").start()


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


def interactive_methods(external: dict[str, tuple[str, str]]) -> bool:
    """Whether a method registered from outside the package lives in a ``__main__`` that a new
    interpreter cannot import (a notebook, ``python -c``)."""
    import sys

    main = sys.modules.get("__main__")
    return any(module == "__main__" and not getattr(main, "__file__", None) for module, _ in external.values())


def script_methods(external: dict[str, tuple[str, str]]) -> bool:
    """Whether a method registered from outside the package is defined in the running script
    (``__main__``): then a sweep's workers must import that script to have it."""
    return any(module in ("__main__", "__mp_main__") for module, _ in external.values())


@contextmanager
def script_hidden(external: dict[str, tuple[str, str]]):
    """Within the block, workers that ``multiprocessing`` spawns do not import the running script
    again (its ``__file__`` and ``__spec__`` hidden from the spawn's preparation), unless a
    registered method lives in it: so a script's top-level code (``fedskew.run`` calls, a sweep
    without ``if __name__ == "__main__":``, a script read from stdin or without a .py suffix) never
    runs again in the workers, which import only fedskew and the methods' modules."""
    import sys

    main = sys.modules.get("__main__")
    if main is None or script_methods(external):
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def unguarded_script_line(frame) -> int | None:
    """The line of the running script (``__main__``, a file) from which ``frame`` was reached, when
    that line is not under ``if __name__ == "__main__":``. Worker processes start by importing the
    script again, so such a line would start the sweep again in every worker, and theirs again."""
    import ast
    import sys

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    while frame is not None and not (frame.f_code.co_name == "<module>"
                                     and frame.f_globals.get("__name__") == "__main__"):
        frame = frame.f_back
    if frame is None or not path or not str(path).endswith(".py") or frame.f_code.co_filename != path:
        return None
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            test = getattr(node, "test", None)
            # `if __name__ == "__main__" and x:`
            tests = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
            guarded = isinstance(node, ast.If) and any(isinstance(t, ast.Compare) and {
                getattr(n, "id", None) or getattr(n, "value", None) for n in (t.left, *t.comparators)
            } == {"__name__", "__main__"} for t in tests)
            return None if guarded else line
    return None


def mp_context(external: dict[str, tuple[str, str]]):
    """spawn (a clean interpreter per worker), unless a registered method cannot be imported by a
    new interpreter (:func:`interactive_methods`): then fork, which inherits it."""
    import multiprocessing

    return multiprocessing.get_context("fork" if interactive_methods(external) else "spawn")


class Recorder(Protocol):
    """What the executing side tells the sweep (its database and events) about a run."""

    def started(self, r: dict) -> None: ...
    def finished(self, r: dict, summary, history, error: str | None = None, env: dict | None = None) -> None: ...
    def interrupted(self, r: dict) -> None: ...
    def round_done(self, report: tuple) -> None: ...


def record_outcomes(rec: Recorder, unit: list[dict], outcomes: list) -> str | None:
    """Record a pack's outcomes (:func:`execute_pack`); the first interruption's message, if a run
    was interrupted."""
    stopped = None
    for r, outcome in zip(unit, outcomes):
        if outcome[0] == "done":
            rec.finished(r, outcome[1], outcome[2], env=outcome[3])
        elif outcome[0] == "failed":
            rec.finished(r, None, None, outcome[1])
        else:
            rec.interrupted(r)
            stopped = stopped or outcome[1]
    return stopped


def run_in_process(units: list[list[dict]], run_dir: dict[str, str], rec: Recorder) -> None:
    """Run ``units`` one after another in this process. A run's failure (even a full disk) is
    recorded and the others go on; an interruption stops here (the run resumes next time)."""
    for unit in units:
        for r in unit:
            rec.started(r)
        if len(unit) > 1:
            try:
                outcomes = execute_pack([r["config"] for r in unit], [run_dir[r["run_id"]] for r in unit],
                                        rec.round_done)
            except BaseException:
                for r in unit:
                    rec.interrupted(r)
                raise
            stopped = record_outcomes(rec, unit, outcomes)
            if stopped:
                raise RunInterrupted(stopped)
            continue
        r = unit[0]
        try:
            summary, history, env = execute_run(r["config"], run_dir[r["run_id"]], rec.round_done)
        except BaseException as exc:
            if not isinstance(exc, Exception) or isinstance(exc, RunInterrupted):
                rec.interrupted(r)
                raise
            rec.finished(r, None, None, error_text(exc))
            continue
        rec.finished(r, summary, history, env=env)


class WorkerPool:
    """``jobs`` worker processes running units of work (:func:`execute_run`, :func:`execute_pack`).
    A run in flight when a worker died is a suspect: it runs again alone (out of any pack), so a run
    that kills its worker (out of memory, a crash in native code) fails by itself and no other is
    lost. On SIGINT/SIGTERM (raised in the sweep process) the workers are told to stop after their
    round, waited for up to :data:`STOP_GRACE_S`, and what is still running is marked interrupted."""

    def __init__(self, jobs: int, rec: Recorder):
        from fedskew.algorithms import external_methods

        self.jobs, self.rec = jobs, rec
        self.external = external_methods()
        self.context = mp_context(self.external)
        self.rounds = None  # one queue per pool: a worker killed while it writes leaves its queue's lock held
        self.running: dict = {}  # future -> unit
        self.pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        self.rounds = self.context.SimpleQueue()
        return ProcessPoolExecutor(self.jobs, mp_context=self.context, initializer=worker_init,
                                   initargs=(self.external, os.getpid(), self.rounds, self.jobs))

    def _workers(self) -> list:
        return list((getattr(self.pool, "_processes", None) or {}).values())

    def _stop(self) -> None:
        procs = self._workers()  # (read first: shutdown forgets them)
        self.pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:  # SIGKILL: a worker takes SIGTERM as "stop after this round" and, idle,
            proc.kill()     # would wait for work for ever, and the pool's thread (so exit) with it

    def _drain(self) -> None:
        while not self.rounds.empty():
            self.rec.round_done(self.rounds.get())

    def _collect(self, fut, unit) -> bool:
        """Record a finished future's runs; False when its worker died."""
        try:
            out = fut.result()
        except BrokenProcessPool:
            return False
        except RunInterrupted:
            for r in unit:
                self.rec.interrupted(r)
        except Exception as exc:
            for r in unit:
                self.rec.finished(r, None, None, error_text(exc))
        else:
            if len(unit) > 1:
                record_outcomes(self.rec, unit, out)
            else:
                self.rec.finished(unit[0], out[0], out[1], env=out[2])
        return True

    def _submit(self, unit, run_dir):
        with script_hidden(self.external):  # (a worker may start here)
            if len(unit) > 1:
                return self.pool.submit(execute_pack, [r["config"] for r in unit], [run_dir[r["run_id"]] for r in unit])
            return self.pool.submit(execute_run, unit[0]["config"], run_dir[unit[0]["run_id"]])

    def _fill(self, queue: list, run_dir: dict, suspects: set) -> None:
        """Submit units while a worker is free; a suspect runs with nothing beside it."""
        def ids(units):
            return {r["run_id"] for unit in units for r in unit}
        while queue and len(self.running) < self.jobs and not (suspects & ids(self.running.values())):
            if suspects & ids(queue[:1]) and self.running:
                break
            unit = queue.pop(0)
            try:
                fut = self._submit(unit, run_dir)
            except BrokenProcessPool:  # a running worker died since the last wait: handled by the caller
                queue.insert(0, unit)
                if not self.running:
                    self._stop()
                    self.pool = self._new_pool()
                break
            for r in unit:
                self.rec.started(r)
            self.running[fut] = unit

    def _lost(self, lost: list[dict], queue: list, suspects: set) -> None:
        """A worker died: the pool is gone with every run in it. A suspect that ran alone is the
        cause and fails; the others run again, each alone."""
        lost += [r for unit in self.running.values() for r in unit]
        self.running.clear()
        self._stop()
        for r in reversed(lost):
            if r["run_id"] in suspects and len(lost) == 1:
                self.rec.finished(r, None, None, "its worker process died while running it (killed, or out of "
                                                 "memory?); run it alone with `fedskew run` to see why")
            else:
                suspects.add(r["run_id"])
                queue.insert(0, [r])
        self.pool = self._new_pool()

    def run(self, units: list[list[dict]], run_dir: dict[str, str],
            more: Callable[[], list[list[dict]]] | None = None) -> None:
        """Run ``units``; with ``more``, asked for further units (their folders added to ``run_dir``)
        whenever the queue is empty and a worker idle, until it gives none and nothing runs."""
        queue, suspects = list(units), set()
        try:
            while True:
                if more is not None and not queue and len(self.running) < self.jobs:
                    queue.extend(more())
                if not queue and not self.running:
                    break
                self._fill(queue, run_dir, suspects)
                done, _ = wait(self.running, timeout=1.0, return_when=FIRST_COMPLETED)
                self._drain()
                lost = [r for fut in done for r in self._finish(fut)]
                if lost:
                    self._lost(lost, queue, suspects)
        except BaseException:  # SIGINT or SIGTERM (the CLI raises them here): stop at the round boundary
            self._stop_gracefully()
            raise
        self.pool.shutdown()

    def _finish(self, fut) -> list[dict]:
        """The unit of a finished future, recorded; its runs when its worker died."""
        unit = self.running.pop(fut)
        return [] if self._collect(fut, unit) else unit

    def _stop_gracefully(self) -> None:
        try:
            for proc in self._workers():
                try:
                    os.kill(proc.pid, signal.SIGTERM)  # (a terminal's Ctrl-C reached them already)
                except OSError:
                    pass
            done, _ = wait(self.running, timeout=STOP_GRACE_S)  # a second signal: stop now
            for fut in done:
                if self._collect(fut, self.running[fut]):
                    self.running.pop(fut)
        finally:
            try:
                for r in [r for unit in self.running.values() for r in unit]:
                    self.rec.interrupted(r)
            finally:
                self._stop()


__all__ = ["AUTO_PACK", "LANE_FREE", "Recorder", "STOP_GRACE_S", "WorkerPool", "check_data", "check_pack",
           "error_text", "execute_pack", "execute_run", "interactive_methods", "pack_key", "pack_size", "packs",
           "run_in_process", "script_hidden", "script_methods", "unguarded_script_line"]
