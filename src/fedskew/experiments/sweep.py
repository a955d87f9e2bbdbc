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
    selection: {split: validation}                 # the default; split: test for a paper's protocol
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

Hyper-parameter selection (``selection.split``): ``validation`` (the default when a method has
more than one point; a sweep with one point per method holds nothing out) holds out
``selection.validation_fraction`` of the training set in every run (``dataset.validation_fraction``)
and picks, per method and partition, the grid point with the best mean over seeds of
``global/val_acc_mean_last10``; ``test`` picks on ``selection.metric`` over the test set, as some
papers' protocols did, and the report names it test-set selection. Either way the choice is
recorded in ``selections`` and shown in the report.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from fedskew.config import ConfigError
from fedskew.engine.durable import FolderLock, atomic_write_text, blocking_file
from fedskew.experiments.pool import STOP_GRACE_S, WorkerPool, check_data, check_pack, pack_key, packs, run_in_process
from fedskew.experiments.selection import PERSONAL_VALIDATION, TIE_TOLERANCE, select
from fedskew.experiments.spec import (
    ADDED_KEYS,
    MethodSpec,
    ResourcesSpec,
    SelectionSpec,
    SweepSpec,
    default_jobs,
    default_sweep_dir,
    grid_points,
    load_spec,
    plan,
    planned_count,
    planned_points,
    rounds_per_run,
    run_identity,
    tune_seeds,
)
from fedskew.experiments.store import (
    add_planned,
    connect,
    mark_interrupted,
    mark_running,
    record_done,
    record_failed,
    writable,
)


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
    check_sweep_folder(sweep_dir)
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


class _Recorder:
    """The sweep process's side of its runs: each start, round, end and interruption goes to the
    results store and to the caller's ``on_event``."""

    def __init__(self, db: sqlite3.Connection, runs: list[dict], on_event):
        self.db, self.on_event = db, on_event
        self.by_id = {r["run_id"]: r for r in runs}

    def event(self, kind: str, r: dict) -> None:
        if self.on_event:
            self.on_event(kind, r)

    def started(self, r: dict) -> None:
        mark_running(self.db, r["run_id"])
        self.event("started", r)

    def finished(self, r: dict, summary, history, error: str | None = None, env: dict | None = None) -> None:
        if error is None:
            record_done(self.db, r["run_id"], summary, history, env)
        else:
            record_failed(self.db, r["run_id"], error)
        self.event("failed" if error else "done", {**r, "summary": summary, "error": error})

    def interrupted(self, r: dict) -> None:
        mark_interrupted(self.db, r["run_id"])

    def round_done(self, report: tuple) -> None:
        run_id, done_rounds, total = report
        if run_id in self.by_id:
            self.event("round", {**self.by_id[run_id], "round": done_rounds, "rounds": total})

    def planned(self, runs: list[dict], sweep_dir: Path, announced: frozenset = frozenset()) -> list[dict]:
        """Add ``runs`` to the store; those not finished yet (the finished ones are "skipped", unless
        ``announced`` as such before)."""
        status = add_planned(self.db, runs, sweep_dir)
        for r in runs:
            if status.get(r["run_id"]) == "done" and r["run_id"] not in announced:
                self.event("skipped", r)
        self.by_id.update({r["run_id"]: r for r in runs})
        return [r for r in runs if status.get(r["run_id"]) != "done"]


SPEC_HEADER = "# the sweep as fedskew ran it (written by fedskew; edit a copy elsewhere)\n"


def own_spec(path: Path):
    """The spec a sweep folder's ``sweep.yaml`` records, when fedskew wrote it (its header, or, for a
    folder of an earlier version, text that is exactly what fedskew writes); else None: a file of the
    user's, which is never replaced."""
    from fedskew.files import FileProblem, parse_yaml, read_text

    try:
        text = read_text(path, "sweep record", own=True)
        data = parse_yaml(text, f"sweep record '{path}'")
    except FileProblem:
        return None
    if not isinstance(data, dict):
        return None
    try:
        written = yaml.safe_dump(data, sort_keys=False)
    except yaml.YAMLError:
        return None
    return data if text.removeprefix(SPEC_HEADER) == written else None


def check_sweep_folder(sweep_dir: Path) -> None:
    """A sweep writes only into a new or empty folder or one a sweep of fedskew made (its results
    database, or its lock and record alone after a crash at the start): a folder of the user's, with
    the sweep file itself or a report of theirs in it, is one sentence and nothing in it changes."""
    from fedskew.engine.durable import LOCK_NAME
    from fedskew.experiments.store import is_store

    if not sweep_dir.is_dir():
        return
    entries = sorted(p.name for p in sweep_dir.iterdir())
    if LOCK_NAME in entries:  # a sweep writing here now (its database perhaps not yet whole): that, first
        FolderLock(sweep_dir, "sweep folder").check_free()
    if not entries or is_store(sweep_dir / "results.sqlite"):
        return
    if set(entries) <= {LOCK_NAME, "sweep.yaml"} and (
            "sweep.yaml" not in entries or own_spec(sweep_dir / "sweep.yaml") is not None):
        return
    raise ConfigError(f"sweep folder '{sweep_dir}' already holds files that no fedskew sweep wrote "
                      f"({', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}), so nothing is written there; "
                      f"give --out a new or empty folder.")


def _write_spec(spec: SweepSpec, sweep_dir: Path) -> None:
    """sweep.yaml: the spec as run (a changed spec keeps the finished runs it still plans); a
    sweep.yaml that fedskew did not write is never replaced."""
    spec_file = sweep_dir / "sweep.yaml"
    spec_data = spec.model_dump(mode="json")
    if os.path.lexists(spec_file):
        previous = own_spec(spec_file)
        if previous is None:
            raise ConfigError(f"'{spec_file}' is not the record fedskew writes of a sweep (a file of yours, or one "
                              f"edited since), so it is not replaced; move it elsewhere or give --out another folder.")
        def what(d):
            return {k: v for k, v in (d or {}).items() if k != "resources"}  # (where runs run, not what)
        if what(previous) != what(spec_data):
            print(f"fedskew: the sweep in {sweep_dir} changes; finished runs whose configuration is unchanged "
                  f"are kept, the others are added.", flush=True)
    atomic_write_text(SPEC_HEADER + yaml.safe_dump(spec_data, sort_keys=False), spec_file)


def _run_locked(spec: SweepSpec, sweep_dir: Path, runs: list[dict], jobs: int, on_event,
                ray: str | None = None, pack: str | int = "off") -> sqlite3.Connection:
    _write_spec(spec, sweep_dir)
    db = connect(sweep_dir / "results.sqlite")
    rec = _Recorder(db, runs, on_event)
    todo = rec.planned(runs, sweep_dir)

    def units_for(todo: list[dict], run_dir: dict[str, str]) -> list[list[dict]]:
        """``todo`` as units of work, in packs formed from every run the sweep knows, finished ones
        included, so that a resumed sweep packs its unfinished runs beside the same runs as before
        (a pack's arithmetic depends on its lanes at float round-off); their folders into ``run_dir``."""
        run_dir.update({r["run_id"]: str(sweep_dir / "runs" / r["run_id"]) for r in todo})
        ids = {r["run_id"] for r in todo}
        return [u for u in ([r for r in unit if r["run_id"] in ids] for unit in packs(list(rec.by_id.values()), pack))
                if u]

    def execute(todo: list[dict]) -> None:
        """Run ``todo`` here, in worker processes or on Ray (Ray reports no rounds)."""
        run_dir: dict[str, str] = {}
        units = units_for(todo, run_dir)
        if ray is not None:
            from fedskew.experiments.on_ray import run_on_ray

            run_on_ray(todo, {k: str(Path(v).resolve()) for k, v in run_dir.items()}, ray, spec.resources,
                       rec.started, rec.finished)
        elif jobs <= 1:
            run_in_process(units, run_dir, rec)
        else:
            WorkerPool(jobs, rec).run(units, run_dir)

    if spec.selection.tune_seeds is None:
        execute(todo)
        select(db, spec)
        return db
    # method by method: its grid on the tuning seeds, then its selected point of each partition on
    # the other seeds, so that a sweep stopped half-way has whole methods (in worker processes, at
    # most three in part: the next method's grid fills the workers the last runs of one leave idle)
    planned = {r["run_id"] for r in runs}
    # the other seeds' runs of every (label, partition) whose grid had finished are known now: those
    # that finished before are announced at once, so that a resumed sweep's progress and ETA count them
    done = {row["run_id"] for row in db.execute("SELECT run_id FROM runs WHERE status='done'")}
    open_grid = {(r["label"], r["partition"]) for r in runs if r["run_id"] not in done}
    known = {k: v for k, v in select(db, spec, record=False).items() if k not in open_grid}
    finished_later = [r for r in plan(spec, known) if r["run_id"] not in planned and r["run_id"] in done]
    for r in finished_later:
        rec.event("skipped", r)
    announced = frozenset(r["run_id"] for r in finished_later)

    def other_seeds(method) -> list[dict]:
        """The runs of ``method``'s selected points on the other seeds (its grid has finished; the
        choices are recorded when the sweep ends: another method's grid may be part-way)."""
        chosen = select(db, spec, record=False)
        more = [r for r in plan(spec.model_copy(update={"methods": [method]}), chosen) if r["run_id"] not in planned]
        return rec.planned(more, sweep_dir, announced)

    if jobs <= 1 or ray is not None:
        for method in spec.methods:
            execute([r for r in todo if r["label"] == method.column])
            execute(other_seeds(method))
    else:
        run_dir: dict[str, str] = {}
        methods = list(spec.methods)
        started: list[list] = []  # [method, its grid's run ids, its other seeds' run ids (None: not planned)]

        def feed() -> list[list[dict]]:
            """The pool's next units when a worker is idle: the other seeds of a method whose grid
            has finished, else the next method's grid while at most two methods are unfinished;
            none while the runs in flight decide what comes next."""
            while True:
                ended = {row[0] for row in db.execute("SELECT run_id FROM runs WHERE status IN ('done', 'failed')")}
                work = None
                for entry in started:
                    if entry[2] is None and entry[1] <= ended:
                        new = other_seeds(entry[0])
                        entry[2] = {r["run_id"] for r in new}
                        work = new
                        break
                if work is None:
                    started[:] = [e for e in started if e[2] is None or not e[2] <= ended]
                    if not methods or len(started) > 2:
                        return []
                    method = methods.pop(0)
                    work = [r for r in todo if r["label"] == method.column]
                    started.append([method, {r["run_id"] for r in work}, None])
                units = units_for(work, run_dir)
                if units:
                    return units

        WorkerPool(jobs, rec).run([], run_dir, more=feed)
    select(db, spec)
    return db


# the sweep's parts, importable from here as before the split: spec (schema, plan, identity), pool
# (execution), selection (the choice and the runs it chose)
__all__ = ["ADDED_KEYS", "MethodSpec", "PERSONAL_VALIDATION", "ResourcesSpec", "STOP_GRACE_S", "SelectionSpec",
           "SweepProgress", "SweepSpec", "TIE_TOLERANCE", "check_pack", "clock", "default_jobs", "default_sweep_dir",
           "grid_points", "load_spec", "pack_key", "packs", "plan", "planned_count", "planned_points", "progress_line",
           "rounds_per_run", "run_identity", "run_sweep", "select", "tune_seeds"]
