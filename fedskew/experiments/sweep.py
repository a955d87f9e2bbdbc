"""Sweeps: methods x method parameters x partitions x seeds from one YAML file, every run recorded
in a SQLite results database, resumable.

A sweep file::

    name: compare-digits
    base: {rounds: 20, executor: vectorized}        # any run config keys (nested or dotted);
                                                    # clients_per_round: all = every client
    methods:
      - fedavg
      - {name: fedmr, options: {mu1: [0.01, 0.001], mu2: 1.0e-4}}   # a list is a grid
      - {name: etf_gmv, label: etf, config: {model.classifier: etf}} # per-method config keys
    partitions:
      P20C3: {name: pcdd, classes_per_client: 3}
      Dir0.5: {name: dirichlet, alpha: 0.5}
    seeds: [0, 1, 2]
    selection: {split: test, metric: global/test_acc_mean_last10}  # or split: validation
    resources: {num_cpus: 1, num_gpus: 0}          # per run, with --ray (docs/scaling.md)

The sweep folder holds ``sweep.yaml`` (the spec as run), ``results.sqlite`` (the results store,
:mod:`fedskew.experiments.store`) and ``runs/<id>/`` (ordinary run directories). Running the sweep
again skips finished runs, resumes interrupted ones from their last checkpoint and retries failed
ones.

A method's ``trials`` is an explicit list of points instead of a grid (``fedskew bench`` gives every
method the same number): ``{name: fedprox, trials: [{mu: 0.01, lr: 0.03}, {mu: 0.1, lr: 0.01}]}``;
a key that names a run setting (``lr``, ``local_epochs``, ``momentum``, ...) sets it, any other is a
method option. ``selection.tune_seeds: [0]`` runs the grid on those seeds only, selects, then runs
the selected point on every other seed (the selection reads the tuning seeds' runs only).

Hyper-parameter selection (``selection.split``): ``test`` picks, per method and partition, the grid
point with the best mean over seeds of ``selection.metric`` on the test set, as the papers did;
``validation`` holds out ``selection.validation_fraction`` of the training set in every run
(``dataset.validation_fraction``) and selects on ``global/val_acc_mean_last10``. Either way the
choice is recorded in ``selections`` and shown in the report.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import sqlite3
import time
from contextlib import contextmanager
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from fedskew.algorithms.base import StrictOptions
from fedskew.config import RECORD_KEYS, ConfigError, did_you_mean, load_yaml, nested, set_key, validate_config
from fedskew.engine.durable import FolderLock, RunInterrupted, atomic_write_text, blocking_file
from fedskew.experiments.store import (add_planned, connect, mark_interrupted, mark_running, record_done, record_failed,
                                      scalar_metrics, writable, writing)

# After SIGTERM or SIGINT, how long the sweep waits for its workers' runs to reach a round boundary
# and checkpoint; a run still in its round then is stopped and resumes from its last checkpoint.
STOP_GRACE_S = 60.0

_Strict = StrictOptions  # unknown keys are errors (one strict base for every schema)


class MethodSpec(_Strict):
    name: str
    label: str | None = None
    options: dict[str, Any] = Field(default_factory=dict, description="method options; a list value is a grid")
    config: dict[str, Any] = Field(default_factory=dict, description="run config keys for this method only")
    trials: list[dict[str, Any]] | None = Field(None, description="explicit points instead of a grid: method "
                                                                   "options and run settings (lr, ...)")

    @model_validator(mode="after")
    def _one_way(self):
        if self.trials is not None:
            grid = sorted(k for k, v in self.options.items() if isinstance(v, list))
            if grid:
                raise ValueError(f"method '{self.column}' gives both trials and a grid ({grid}); give one")
            if not self.trials:
                raise ValueError(f"method '{self.column}' gives an empty trials list")
        return self

    @property
    def column(self) -> str:
        return self.label or self.name


class SelectionSpec(_Strict):
    split: Literal["test", "validation"] = "test"
    metric: str | None = Field(None, description="default: global/test_acc_mean_last10 (test) or "
                                                 "global/val_acc_mean_last10 (validation)")
    validation_fraction: float = Field(0.1, gt=0, lt=1)
    tune_seeds: list[int] | None = Field(None, description="run the grid on these seeds only, then the selected "
                                                           "point on every other seed (default: the grid on all)")

    @model_validator(mode="after")
    def _validation_never_reads_test(self):
        if self.split == "validation" and self.metric and not self.metric.startswith("global/val_"):
            raise ValueError(f"selection.metric '{self.metric}' reads test data; with split: validation select on a "
                             f"global/val_* metric (default global/val_acc_mean_last10)")
        return self

    @property
    def key(self) -> str:
        return self.metric or ("global/val_acc_mean_last10" if self.split == "validation" else
                               "global/test_acc_mean_last10")


class ResourcesSpec(_Strict):
    """What one run asks of a Ray node (``fedskew sweep FILE --ray``); fractions share a GPU."""

    num_cpus: float = Field(1.0, gt=0, description="CPUs per run (its torch threads: the integer part, at least 1)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per run; 0.5 puts two runs on one GPU")


class SweepSpec(_Strict):
    name: str = "sweep"
    base: dict[str, Any] = Field(default_factory=dict)
    methods: list[MethodSpec]
    partitions: dict[str, dict[str, Any]] = Field(default_factory=lambda: {"default": {}})
    seeds: list[int] = Field(default_factory=lambda: [0])
    selection: SelectionSpec = Field(default_factory=SelectionSpec)
    report: dict[str, Any] = Field(default_factory=dict, description="options of fedskew report (metric, baseline)")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="per run, on Ray (--ray)")

    @field_validator("methods", mode="before")
    @classmethod
    def _names(cls, v):
        return [{"name": m} if isinstance(m, str) else m for m in (v or [])]

    @field_validator("methods")
    @classmethod
    def _unique(cls, v):
        columns = [m.column for m in v]
        dup = sorted({c for c in columns if columns.count(c) > 1})
        if dup:
            raise ValueError(f"methods {dup} appear twice; give each a distinct label")
        if not v:
            raise ValueError("at least one method is needed")
        return v


def load_spec(data: dict | str | Path) -> SweepSpec:
    """A sweep spec from a mapping or a YAML file, with one-sentence errors."""
    if not isinstance(data, dict):
        path = Path(data)
        if not path.is_file():
            raise ConfigError(f"sweep file '{path}' does not exist.")
        data = load_yaml(path.read_text(errors="replace"), f"sweep file '{path}'") or {}
        if not isinstance(data, dict):
            raise ConfigError(f"sweep file '{path}' must hold a mapping of keys, not a {type(data).__name__}.")
    try:
        return SweepSpec.model_validate(data)
    except ValidationError as exc:
        err = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")[0]
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "missing":
            raise ConfigError(f"sweep key '{key}' is missing; a sweep needs at least 'methods' (a list of method "
                              f"names or mappings).") from None
        if err["type"] == "extra_forbidden":
            fields = MethodSpec.model_fields if err["loc"][0] == "methods" else SweepSpec.model_fields
            hint = did_you_mean(str(err["loc"][-1]), fields)
            raise ConfigError(f"sweep key '{key}' is not known{hint}; allowed: {sorted(SweepSpec.model_fields)} "
                              f"(and in methods: {sorted(MethodSpec.model_fields)}).") from None
        raise ConfigError(f"sweep key '{key}' = {err.get('input')!r} is not allowed: "
                          f"{err['msg'].removeprefix('Value error, ')}.") from None


# ---------------------------------------------------------------------------------------------
# Planning


def grid_points(options: dict[str, Any], trials: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every combination of the list-valued options (the others fixed), in a stable order; with
    ``trials``, those points over the fixed options."""
    if trials is not None:
        return [{**options, **t} for t in trials]
    keys = sorted(k for k, v in options.items() if isinstance(v, list))
    fixed = {k: v for k, v in options.items() if not isinstance(v, list)}
    if any(not options[k] for k in keys):
        raise ConfigError(f"method option grid {[k for k in keys if not options[k]]} is empty.")
    return [{**fixed, **dict(zip(keys, combo))} for combo in itertools.product(*(options[k] for k in keys))]


def run_config(spec: SweepSpec, method: MethodSpec, params: dict, partition: str, seed: int) -> dict:
    """The resolved run config (plain data) of one planned run."""
    data = nested(spec.base)
    for k, v in nested(method.config).items():
        if isinstance(v, dict) and isinstance(data.get(k), (dict, str)):
            base = {"name": data[k]} if isinstance(data[k], str) else data[k]
            data[k] = {**base, **v}
        else:
            data[k] = v
    run_keys = {k: v for k, v in params.items() if k in RUN_SETTINGS}
    data["method"] = {"name": method.name, **{k: v for k, v in params.items() if k not in run_keys}}
    data.update(run_keys)
    part = data.get("partition", {})
    data["partition"] = {**({"name": part} if isinstance(part, str) else part), **spec.partitions[partition]}
    data["seed"] = seed
    if data.get("clients_per_round") == "all":  # every client of the partition, every round
        data["clients_per_round"] = data["partition"].get("num_clients", 20)
    if spec.selection.split == "validation":
        set_key(data, "dataset.validation_fraction", spec.selection.validation_fraction)
    if data.get("logger") and not data.get("logger_group"):  # one tracked run per sweep run, grouped by sweep
        data["logger_group"] = spec.name
    return validate_config(data).model_dump(mode="json")


NOT_IDENTITY = ("logger", "logger_group")  # where a run is also logged does not change what it computes
# run settings a grid point may set (``trials``); any other key of a point is a method option
RUN_SETTINGS = ("lr", "local_epochs", "batch_size", "momentum", "weight_decay", "lr_decay", "grad_clip")

# Config keys added after sweep run ids were first hashed, each with the value that means "as before
# the key existed": a run at that value keeps the id it had, so a new option (a new method's model
# switch) never orphans the finished runs of a sweep. tests/test_sweep.py pins an id: a key added to
# the schema without an entry here fails it.
ADDED_KEYS = {"model.conditional_policy": False, "model.dropout": 0.0}


def run_identity(cfg: dict) -> dict:
    """The part of a resolved run config that names the run: all of it but :data:`NOT_IDENTITY`,
    and the :data:`ADDED_KEYS` that are at their as-before value."""
    out = {k: v for k, v in cfg.items() if k not in NOT_IDENTITY}
    for dotted, before in ADDED_KEYS.items():
        head, leaf = dotted.split(".")
        if isinstance(out.get(head), dict) and out[head].get(leaf, before) == before:
            out[head] = {k: v for k, v in out[head].items() if k != leaf}
    return out


def tune_seeds(spec: SweepSpec) -> list[int]:
    """The seeds the grid runs on (every seed unless ``selection.tune_seeds``)."""
    return spec.seeds if spec.selection.tune_seeds is None else spec.selection.tune_seeds


def plan(spec: SweepSpec, chosen: dict[tuple[str, str], dict] | None = None) -> list[dict]:
    """Every run of the sweep: id, label, method, grid point, partition, seed, config. With
    ``selection.tune_seeds``: the grid on those seeds, then, for each (label, partition) in
    ``chosen`` (:func:`select`'s answer), its point on the other seeds."""
    runs = []
    for method in spec.methods:
        for params in grid_points(method.options, method.trials):
            for partition in spec.partitions:
                seeds = list(tune_seeds(spec))
                if spec.selection.tune_seeds is not None and (chosen or {}).get((method.column, partition),
                                                                               {}).get("params") == params:
                    seeds += [s for s in spec.seeds if s not in seeds]
                for seed in seeds:
                    cfg = run_config(spec, method, params, partition, seed)
                    key = json.dumps([method.column, params, partition, seed, run_identity(cfg)], sort_keys=True)
                    runs.append({"run_id": hashlib.sha1(key.encode()).hexdigest()[:12], "label": method.column,
                                 "method": method.name, "params": params, "partition": partition, "seed": seed,
                                 "config": cfg})
    return runs


def planned_points(spec: SweepSpec) -> set[tuple[str, str]]:
    """(method label, grid point as stored in the results database) of every point the sweep's
    grid has now: what selection and a trial count may read."""
    return {(m.column, json.dumps(p, sort_keys=True)) for m in spec.methods for p in grid_points(m.options, m.trials)}


def planned_count(spec: SweepSpec) -> int:
    """How many runs the sweep makes: :func:`plan`'s, plus (with ``selection.tune_seeds``) the
    selected point of every group on the other seeds."""
    extra = len([s for s in spec.seeds if s not in tune_seeds(spec)]) * len(spec.methods) * len(spec.partitions)
    return len(plan(spec)) + (extra if spec.selection.tune_seeds is not None else 0)


def rounds_per_run(spec: SweepSpec) -> float:
    """The mean number of rounds of the sweep's runs (what its progress counts in)."""
    runs = plan(spec)
    return sum(int(r["config"].get("rounds", 0) or 0) for r in runs) / max(1, len(runs))


_ROUNDS = None  # in a worker: the queue on which it tells the sweep process (run_id, rounds done, rounds)


def _execute(config: dict, run_dir: str, report: Callable[[tuple], None] | None = None) -> tuple[dict, list[dict]]:
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
LANE_FREE = frozenset({"seed", "lr", "lr_decay", "partition", "rounds", "clients_per_round", "eval_every",
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


def _execute_pack(configs: list[dict], run_dirs: list[str], report: Callable[[tuple], None] | None = None) -> list:
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
            outcomes[i] = ("failed", _error_text(exc))
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
            outcomes[i] = ("failed", _error_text(result))
        else:
            outcomes[i] = ("done", result.summary, [scalar_metrics(h) for h in result.history], result.environment)
    return outcomes


class SweepProgress:
    """A sweep's progress from its events ("skipped", "started", "round", "done", "failed"): runs
    and rounds done, the runs running, elapsed seconds and an ETA from the round rate measured in
    this process from its first round report on (every worker's rounds together, so parallelism is
    in it; resumed and skipped rounds, and the workers' start-up, are not)."""

    def __init__(self, runs: int, rounds_per_run: float):
        self.runs, self.rounds = runs, round(runs * rounds_per_run)
        self.t0 = time.perf_counter()
        self.counts = {"done": 0, "failed": 0, "skipped": 0}
        self.running: dict[str, int | None] = {}  # run_id -> rounds done (None: none reported yet)
        self.finished_rounds = 0
        self.trained = 0  # rounds trained since this process started
        self.first_round: tuple[float, int] | None = None  # (time, trained) at the first round reported
        self.last_line = self.t0

    def update(self, kind: str, r: dict) -> dict:
        rid = r["run_id"]
        if kind == "started":
            self.running[rid] = None
        elif kind == "round" and rid in self.running:  # (a late report of a finished run changes nothing)
            before = self.running[rid]
            self.trained += 1 if before is None else max(0, r["round"] - before)
            self.running[rid] = r["round"]
            if self.first_round is None:
                self.first_round = (time.perf_counter(), self.trained)
        elif kind in self.counts:
            self.counts[kind] += 1
            rounds = int(r["config"].get("rounds", 0) or 0)
            if kind == "done" and rid in self.running and self.running[rid] is None:
                self.trained += rounds  # a run that reported no rounds (Ray): its rounds at once
            self.running.pop(rid, None)
            self.finished_rounds += rounds
        return self.snapshot()

    def line_due(self, kind: str, every_s: float = 30.0) -> bool:
        """Whether a plain progress line is due after this event: after each finished run, and
        for round reports at most every ``every_s`` seconds."""
        now = time.perf_counter()
        if kind in ("done", "failed") or kind == "round" and now - self.last_line >= every_s:
            self.last_line = now
            return True
        return False

    def snapshot(self) -> dict:
        now = time.perf_counter()
        elapsed = now - self.t0
        rounds_done = min(self.rounds, self.finished_rounds + sum(v or 0 for v in self.running.values()))
        # the round rate from the first round on: the workers' start-up (importing torch, loading data)
        # is not round time, and counted in, it made the first ETAs 10-40x too long
        if self.first_round is not None and self.trained > self.first_round[1] and now > self.first_round[0]:
            rate = (self.trained - self.first_round[1]) / (now - self.first_round[0])
        else:
            rate = self.trained / elapsed if self.trained and elapsed > 0 and self.first_round is None else None
        return {"runs_done": sum(self.counts.values()), "runs_failed": self.counts["failed"],
                "runs_running": len(self.running), "runs_total": self.runs, "rounds_done": rounds_done,
                "rounds_total": self.rounds, "elapsed_s": elapsed,
                "eta_s": (self.rounds - rounds_done) / rate if rate else None}


def progress_line(p: dict) -> str:
    """One plain line of a :class:`SweepProgress` snapshot (logs, ``fedskew.sweep(progress=True)``)."""
    eta = "?" if p["eta_s"] is None else clock(p["eta_s"])
    return (f"{p['runs_done']}/{p['runs_total']} runs ({p['runs_running']} running, {p['runs_failed']} failed), "
            f"{p['rounds_done']}/{p['rounds_total']} rounds; {clock(p['elapsed_s'])} elapsed, ETA {eta}")


def clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


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


def _worker_init(external: dict[str, tuple[str, str]], parent: int, rounds=None) -> None:
    """A sweep worker: it dies with the sweep process ``parent``, stops its run after the current
    round on SIGTERM or SIGINT (the sweep forwards them), reports each round on ``rounds``, one
    torch thread, and the methods registered from outside the package."""
    import signal

    global _ROUNDS
    _ROUNDS = rounds

    from fedskew.engine.durable import stop_after_this_round

    _die_with_parent(parent)
    signal.signal(signal.SIGTERM, stop_after_this_round)
    signal.signal(signal.SIGINT, stop_after_this_round)
    import torch

    from fedskew.algorithms import import_methods

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


def _error_text(exc: BaseException) -> str:
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
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__"):
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
            tests = node.test.values if isinstance(getattr(node, "test", None), ast.BoolOp) and \
                isinstance(node.test.op, ast.And) else [getattr(node, "test", None)]  # `if __name__ == "__main__" and x:`
            guarded = isinstance(node, ast.If) and any(isinstance(t, ast.Compare) and {
                getattr(n, "id", None) or getattr(n, "value", None) for n in (t.left, *t.comparators)
            } == {"__name__", "__main__"} for t in tests)
            return None if guarded else line
    return None


def _mp_context(external: dict[str, tuple[str, str]]):
    """spawn (a clean interpreter per worker), unless a registered method cannot be imported by a
    new interpreter (:func:`interactive_methods`): then fork, which inherits it."""
    import multiprocessing

    return multiprocessing.get_context("fork" if interactive_methods(external) else "spawn")


def run_sweep(spec: SweepSpec, sweep_dir: str | Path, jobs: int = 1,
              on_event: Callable[[str, dict], None] | None = None, ray: str | None = None,
              pack: str | int = "auto") -> sqlite3.Connection:
    """Run every planned run that has not finished; returns the open database. ``jobs`` > 1 runs
    that many runs (or packs) at once in worker processes with one torch thread each; ``ray``
    (``"local"``: a Ray instance started for the sweep, else a cluster address such as ``auto`` or
    ``ray://host:10001``) submits them as Ray tasks with ``spec.resources`` instead. ``pack``
    (:func:`packs`): runs on the vectorised executor that differ only in seed, partition, learning
    rate, rounds or float method options train as lanes of one program, up to N runs a pack
    (``auto``: on a CUDA device; ``off``: never)."""
    pack = check_pack(pack)
    sweep_dir = Path(sweep_dir)
    if ray is not None:
        from fedskew.experiments.on_ray import check_address

        check_address(ray)
    runs = plan(spec)
    if (sweep_dir / "results.sqlite").is_file() and not writable(sweep_dir):
        return _finished_read_only(spec, sweep_dir, runs, on_event)
    check_data(runs)
    blocked = blocking_file(sweep_dir)
    if blocked is not None:
        raise ConfigError(f"sweep folder '{sweep_dir}' cannot be created: '{blocked}' is a file, not a folder.")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    lock = FolderLock(sweep_dir, "sweep folder").acquire()  # one sweep process per folder, for its life
    try:
        db = _run_locked(spec, sweep_dir, runs, jobs, on_event, ray, pack)
    finally:
        lock.release()
    return db


def _finished_read_only(spec: SweepSpec, sweep_dir: Path, runs: list[dict], on_event) -> sqlite3.Connection:
    """A sweep folder this process cannot write (a read-only mount, an archive): its results when
    every planned run has finished, else one sentence."""
    db = connect(sweep_dir / "results.sqlite", read_only=True)
    if spec.selection.tune_seeds is not None:
        runs = plan(spec, select(db, spec, record=False))
    status = {row["run_id"]: row["status"] for row in db.execute("SELECT run_id, status FROM runs")}
    todo = sum(status.get(r["run_id"]) != "done" for r in runs)
    if todo:
        db.close()
        from fedskew.engine.rundir import StorageError

        raise StorageError(f"sweep folder '{sweep_dir}' is read-only and {todo} of its {len(runs)} runs have not "
                           f"finished; make it writable, or copy it elsewhere and run the sweep there.")
    for r in runs:
        if on_event:
            on_event("skipped", r)
    return db


def _run_locked(spec: SweepSpec, sweep_dir: Path, runs: list[dict], jobs: int, on_event,
                ray: str | None = None, pack: str | int = "off") -> sqlite3.Connection:
    spec_file = sweep_dir / "sweep.yaml"
    spec_data = spec.model_dump(mode="json")
    if spec_file.is_file():
        previous = yaml.safe_load(spec_file.read_text())
        what = lambda d: {k: v for k, v in (d or {}).items() if k != "resources"}  # (where runs run, not what)
        if what(previous) != what(spec_data):
            print(f"fedskew: the sweep in {sweep_dir} changes; finished runs whose configuration is unchanged "
                  f"are kept, the others are added.", flush=True)
    atomic_write_text(yaml.safe_dump(spec_data, sort_keys=False), spec_file)
    db = connect(sweep_dir / "results.sqlite")
    status = add_planned(db, runs, sweep_dir)
    todo = [r for r in runs if status.get(r["run_id"]) != "done"]
    for r in runs:
        if status.get(r["run_id"]) == "done" and on_event:
            on_event("skipped", r)

    def started(r):
        mark_running(db, r["run_id"])
        if on_event:
            on_event("started", r)

    def finished(r, summary, history, error=None, env=None):
        if error is None:
            record_done(db, r["run_id"], summary, history, env)
        else:
            record_failed(db, r["run_id"], error)
        if on_event:
            on_event("failed" if error else "done", {**r, "summary": summary, "error": error})

    by_id = {r["run_id"]: r for r in runs}

    def round_done(report: tuple) -> None:
        run_id, done_rounds, total = report
        if on_event and run_id in by_id:
            on_event("round", {**by_id[run_id], "round": done_rounds, "rounds": total})

    def outcomes_of(unit: list[dict], outcomes: list) -> str | None:
        """Record a pack's outcomes; the first interruption's message, if one was interrupted."""
        stopped = None
        for r, outcome in zip(unit, outcomes):
            if outcome[0] == "done":
                finished(r, outcome[1], outcome[2], env=outcome[3])
            elif outcome[0] == "failed":
                finished(r, None, None, outcome[1])
            else:
                mark_interrupted(db, r["run_id"])
                stopped = stopped or outcome[1]
        return stopped

    def units(todo: list[dict]) -> list[list[dict]]:
        """``todo`` in packs formed from every run the sweep knows, finished ones included, so that a
        resumed sweep packs its unfinished runs beside the same runs as before (a pack's arithmetic
        depends on its lanes at float round-off)."""
        left = {r["run_id"] for r in todo}
        return [u for u in ([r for r in unit if r["run_id"] in left] for unit in packs(list(by_id.values()), pack)) if u]

    def execute(todo: list[dict]) -> None:
        """Run ``todo`` here, in worker processes or on Ray (Ray reports no rounds)."""
        by_id.update({r["run_id"]: r for r in todo})
        run_dir = {r["run_id"]: str(sweep_dir / "runs" / r["run_id"]) for r in todo}
        if ray is not None:
            from fedskew.experiments.on_ray import run_on_ray

            run_on_ray(todo, {k: str(Path(v).resolve()) for k, v in run_dir.items()}, ray, spec.resources, started,
                       finished)
        elif jobs <= 1:
            for unit in units(todo):
                for r in unit:
                    started(r)
                if len(unit) > 1:
                    try:
                        outcomes = _execute_pack([r["config"] for r in unit], [run_dir[r["run_id"]] for r in unit],
                                                 round_done)
                    except BaseException:
                        for r in unit:
                            mark_interrupted(db, r["run_id"])
                        raise
                    stopped = outcomes_of(unit, outcomes)
                    if stopped:
                        raise RunInterrupted(stopped)
                    continue
                r = unit[0]
                try:
                    summary, history, env = _execute(r["config"], run_dir[r["run_id"]], round_done)
                except BaseException as exc:  # any run's failure (even a full disk) is recorded; the others go on
                    if not isinstance(exc, Exception) or isinstance(exc, RunInterrupted):
                        mark_interrupted(db, r["run_id"])
                        raise
                    finished(r, None, None, _error_text(exc))
                    continue
                finished(r, summary, history, env=env)
        else:
            from fedskew.algorithms import external_methods

            external = external_methods()
            context = _mp_context(external)
            rounds = []  # one queue per pool: a worker killed while it writes leaves its queue's lock held

            def new_pool():
                rounds.append(context.SimpleQueue())
                return ProcessPoolExecutor(jobs, mp_context=context, initializer=_worker_init,
                                           initargs=(external, os.getpid(), rounds[-1]))

            def drain():
                while not rounds[-1].empty():
                    round_done(rounds[-1].get())

            def workers(pool):
                return list((getattr(pool, "_processes", None) or {}).values())

            def stop(pool):
                procs = workers(pool)  # (read first: shutdown forgets them)
                pool.shutdown(wait=False, cancel_futures=True)
                for proc in procs:  # SIGKILL: a worker takes SIGTERM as "stop after this round" and, idle,
                    proc.kill()     # would wait for work for ever, and the pool's thread (so exit) with it

            def collect(fut, unit) -> bool:
                """Record a finished future's runs; False when its worker died."""
                try:
                    out = fut.result()
                except BrokenProcessPool:
                    return False
                except RunInterrupted:
                    for r in unit:
                        mark_interrupted(db, r["run_id"])
                except Exception as exc:
                    for r in unit:
                        finished(r, None, None, _error_text(exc))
                else:
                    if len(unit) > 1:
                        outcomes_of(unit, out)
                    else:
                        finished(unit[0], out[0], out[1], env=out[2])
                return True

            def submit(pool, unit):
                with script_hidden(external):  # (a worker may start here)
                    if len(unit) > 1:
                        return pool.submit(_execute_pack, [r["config"] for r in unit],
                                           [run_dir[r["run_id"]] for r in unit])
                    return pool.submit(_execute, unit[0]["config"], run_dir[unit[0]["run_id"]])

            # A run in flight when a worker died is a suspect: it runs again alone (out of any pack), so
            # a run that kills its worker (out of memory, a crash in native code) fails by itself and no
            # other is lost.
            pool, queue, running, suspects = new_pool(), units(todo), {}, set()
            ids = (lambda units: {r["run_id"] for unit in units for r in unit})
            try:
                while queue or running:
                    while queue and len(running) < jobs and not (suspects & ids(running.values())):
                        if suspects & ids(queue[:1]) and running:
                            break
                        unit = queue.pop(0)
                        try:
                            fut = submit(pool, unit)
                        except BrokenProcessPool:  # a running worker died since the last wait: handled below
                            queue.insert(0, unit)
                            if not running:
                                stop(pool)
                                pool = new_pool()
                            break
                        for r in unit:
                            started(r)
                        running[fut] = unit
                    done, _ = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
                    drain()
                    lost = []
                    for fut in done:
                        unit = running.pop(fut)
                        if not collect(fut, unit):
                            lost += unit
                    if lost:  # a worker died: the pool is gone with every run in it
                        lost += [r for unit in running.values() for r in unit]
                        running.clear()
                        stop(pool)
                        for r in reversed(lost):
                            if r["run_id"] in suspects and len(lost) == 1:  # it ran alone: it is the cause
                                finished(r, None, None, "its worker process died while running it (killed, or out of "
                                                        "memory?); run it alone with `fedskew run` to see why")
                            else:
                                suspects.add(r["run_id"])
                                queue.insert(0, [r])
                        pool = new_pool()
            except BaseException:  # SIGINT or SIGTERM (the CLI raises them here): stop at the round boundary
                try:
                    for proc in workers(pool):
                        try:
                            os.kill(proc.pid, signal.SIGTERM)  # (a terminal's Ctrl-C reached them already)
                        except OSError:
                            pass
                    done, _ = wait(running, timeout=STOP_GRACE_S)  # a second signal: stop now
                    for fut in done:
                        if collect(fut, running[fut]):
                            running.pop(fut)
                finally:
                    try:
                        for r in [r for unit in running.values() for r in unit]:
                            mark_interrupted(db, r["run_id"])
                    finally:
                        stop(pool)
                raise
            pool.shutdown()

    if spec.selection.tune_seeds is None:
        execute(todo)
        select(db, spec)
        return db
    # one method at a time: its grid on the tuning seeds, then its selected point of each partition on
    # the other seeds, so that a sweep stopped half-way has whole methods
    planned = {r["run_id"] for r in runs}
    for method in spec.methods:
        execute([r for r in todo if r["label"] == method.column])
        chosen = select(db, spec)
        more = [r for r in plan(spec.model_copy(update={"methods": [method]}), chosen) if r["run_id"] not in planned]
        status = add_planned(db, more, sweep_dir)
        for r in more:
            if status.get(r["run_id"]) == "done" and on_event:
                on_event("skipped", r)
        execute([r for r in more if status.get(r["run_id"]) != "done"])
    select(db, spec)
    return db


# ---------------------------------------------------------------------------------------------
# Selection


# what a validation selection reads for a method without a global model (FedRep, FedCP, pFedHN):
# its clients' personal models on the hold-out, each weighted to its client's classes
PERSONAL_VALIDATION = "personal/final_val_acc_after"


# Selection means closer than this (relative) are a tie: sums of the same accuracies in another order
# differ in the last bits, and a choice must not depend on that
TIE_TOLERANCE = 1e-9


def select(db: sqlite3.Connection, spec: SweepSpec, record: bool = True) -> dict[tuple[str, str], dict]:
    """Per (method label, partition): the grid point with the best mean over seeds of the
    selection metric among finished runs at the points of the sweep's current grid (the runs of
    an earlier grid stay in the database and out of the choice); on a validation split, a method
    whose runs have no global model is chosen by :data:`PERSONAL_VALIDATION`. Means within
    :data:`TIE_TOLERANCE` of the best are a tie, won by the earliest point of the grid (the method's
    defaults come first in a bench's trials). Recorded in ``selections`` unless ``record`` is False."""
    metric = spec.selection.key
    chosen = {}
    rows = db.execute("SELECT label, partition, params, seed, summary FROM runs WHERE status='done'").fetchall()
    summaries: dict[tuple[str, str], list[tuple[str, dict]]] = {}
    tuning = set(tune_seeds(spec))
    planned = planned_points(spec)
    for row in rows:
        if row["seed"] in tuning and (row["label"], row["params"]) in planned:
            summaries.setdefault((row["label"], row["partition"]), []).append((row["params"],
                                                                                json.loads(row["summary"])))
    groups: dict[tuple[str, str], dict[str, list[float]]] = {}
    used: dict[tuple[str, str], str] = {}
    for group, found in summaries.items():
        # no run of the group has a global model: its personal models on the hold-out choose
        personal = spec.selection.split == "validation" and all(s.get(metric) is None for _, s in found) and \
            any(s.get(PERSONAL_VALIDATION) is not None for _, s in found)
        key = used[group] = PERSONAL_VALIDATION if personal else metric
        for params, s in found:
            bucket = groups.setdefault(group, {}).setdefault(params, [])
            if s.get(key) is not None:
                bucket.append(float(s[key]))
    order = {(m.column, json.dumps(p, sort_keys=True)): i for m in spec.methods
             for i, p in enumerate(grid_points(m.options, m.trials))}
    rows = []
    for (label, partition), candidates in groups.items():
        means = {p: (sum(v) / len(v) if v else None) for p, v in candidates.items()}
        scored = [p for p, m in means.items() if m is not None]
        if scored:  # the best mean; a tie within float round-off goes to the earlier trial (the defaults first)
            top = max(means[p] for p in scored)
            tied = [p for p in scored if means[p] >= top - TIE_TOLERANCE * max(1.0, abs(top))]
            best = min(tied, key=lambda p: (order.get((label, p), len(order)), p))
        else:
            best = sorted(means)[0]
        chosen[(label, partition)] = {"params": json.loads(best), "value": means[best], "row": dict(
            label=label, partition=partition, params=best, metric=used[(label, partition)],
            split=spec.selection.split, value=means[best], means=json.dumps(means))}
        rows.append(tuple(chosen[(label, partition)]["row"].values()))
    if record:
        with writing(db):
            db.executemany("INSERT OR REPLACE INTO selections VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    return chosen


def default_sweep_dir(spec: SweepSpec) -> Path:
    """``runs/sweep-<name>``, the name made safe for a folder."""
    slug = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in spec.name.split(":")[0]).strip("-")
    return Path("runs") / f"sweep-{slug}"


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))


__all__ = ["MethodSpec", "ResourcesSpec", "SweepProgress", "SweepSpec", "check_pack", "clock", "default_jobs",
           "default_sweep_dir", "grid_points", "load_spec", "pack_key", "packs", "plan", "planned_count", "planned_points", "progress_line", "rounds_per_run",
           "run_sweep", "select", "tune_seeds"]
