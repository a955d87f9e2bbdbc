"""The results store of a sweep: one SQLite file (``results.sqlite``) beside the run directories.

Tables: ``runs`` (one row per planned run: label, method, grid point, partition, seed, status
pending/running/interrupted/done/failed, resolved config, summary), ``rounds`` (the scalar metrics of every
round of every finished run), ``selections`` (the grid point chosen per method and partition, the
metric and the split it was chosen on). Only the sweep process writes it (design.md, "Sweeps and
the results store"); reports and :func:`results_table` only read it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
  run_id TEXT PRIMARY KEY, label TEXT NOT NULL, method TEXT NOT NULL, params TEXT NOT NULL,
  partition TEXT NOT NULL, seed INTEGER NOT NULL, status TEXT NOT NULL, config TEXT NOT NULL,
  summary TEXT, run_dir TEXT NOT NULL, started REAL, finished REAL, error TEXT, environment TEXT);
CREATE TABLE IF NOT EXISTS rounds (
  run_id TEXT NOT NULL, round INTEGER NOT NULL, metrics TEXT NOT NULL, PRIMARY KEY (run_id, round));
CREATE TABLE IF NOT EXISTS selections (
  label TEXT NOT NULL, partition TEXT NOT NULL, params TEXT NOT NULL, metric TEXT NOT NULL, split TEXT NOT NULL,
  value REAL, candidates TEXT NOT NULL, PRIMARY KEY (label, partition));
"""


LOCK_WAIT_S = 30.0  # how long a writer or reader waits for another process holding the database


def connect(path: Path, read_only: bool = False) -> sqlite3.Connection:
    """The results database at ``path``, created if new; ``read_only`` (a report, a listing) opens
    it without writing, as a read-only folder allows. A database that another process holds past
    :data:`LOCK_WAIT_S`, or a file that is not one, is one sentence."""
    from fedskew.config import ConfigError

    try:
        db = (sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True, timeout=LOCK_WAIT_S) if read_only
              else sqlite3.connect(path, timeout=LOCK_WAIT_S))
        db.row_factory = sqlite3.Row
        db.executescript("SELECT COUNT(*) FROM runs;" if read_only else SCHEMA)
    except sqlite3.DatabaseError as exc:
        if _unwritable(exc):
            raise _write_error(path, exc) from None
        raise ConfigError(f"'{path}' is not a fedskew results database ({exc}); move it away or use another sweep "
                          f"folder.") from None
    if read_only:
        return db
    if "environment" not in {row["name"] for row in db.execute("PRAGMA table_info(runs)")}:  # stores before 0.2
        with writing(db):
            db.execute("ALTER TABLE runs ADD COLUMN environment TEXT")
    return db


def _unwritable(exc: sqlite3.DatabaseError) -> bool:
    return any(word in str(exc) for word in ("locked", "busy", "full", "readonly", "disk I/O"))


def _write_error(path, exc: sqlite3.DatabaseError) -> Exception:
    """One sentence for a database that cannot be written now (held by another process, a full
    disk, a read-only folder); the sweep is resumable, so it says how to continue."""
    from fedskew.config import ConfigError
    from fedskew.engine.rundir import StorageError

    if "locked" in str(exc) or "busy" in str(exc):
        return ConfigError(f"'{path}' is locked by another process (waited {LOCK_WAIT_S:g} s): a sweep writing it, "
                           f"or a program holding it open; try again when that is done.")
    return StorageError(f"writing the results database '{path}' failed ({exc}); free space (or make the folder "
                        f"writable) and run the same sweep again: finished runs are kept, the others resume.")


@contextmanager
def writing(db: sqlite3.Connection):
    """One transaction on ``db``; a database that cannot be written is one sentence."""
    try:
        with db:
            yield db
    except sqlite3.DatabaseError as exc:
        if not _unwritable(exc):
            raise
        raise _write_error(db.execute("PRAGMA database_list").fetchone()[2], exc) from None


def open_sweep(sweep_dir: str | Path) -> sqlite3.Connection:
    """The results database of an existing sweep folder (one-sentence error otherwise)."""
    path = Path(sweep_dir) / "results.sqlite"
    if not path.is_file():
        from fedskew.config import ConfigError

        raise ConfigError(f"'{sweep_dir}' is not a sweep folder (it holds no results.sqlite).")
    return connect(path, read_only=not writable(sweep_dir))


def writable(sweep_dir: str | Path) -> bool:
    """Whether this process may write the sweep folder and its database (False on a read-only
    mount, where even root may not)."""
    path = Path(sweep_dir) / "results.sqlite"
    return os.access(path.parent, os.W_OK) and (not path.exists() or os.access(path, os.W_OK))


def run_dir_of(db: sqlite3.Connection, run_id: str) -> Path:
    """A run's directory, found beside the database (``runs/<id>``) wherever the sweep folder is
    now and whatever the working directory was when it ran."""
    return Path(db.execute("PRAGMA database_list").fetchone()[2]).parent / "runs" / run_id


def scalar_metrics(record: dict) -> dict:
    """The per-round values worth keeping in the database (numbers and none; no per-client lists)."""
    return {k: v for k, v in record.items() if v is None or isinstance(v, (int, float))}


# ---------------------------------------------------------------------------------------------
# Writing (the sweep process only)


def add_planned(db: sqlite3.Connection, runs: list[dict], sweep_dir: Path) -> dict[str, str]:
    """Insert the planned runs not yet in the database as ``pending``; every run's status."""
    with writing(db):
        for r in runs:
            db.execute("INSERT OR IGNORE INTO runs (run_id, label, method, params, partition, seed, status, config, "
                       "run_dir) VALUES (?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
                       (r["run_id"], r["label"], r["method"], json.dumps(r["params"], sort_keys=True), r["partition"],
                        r["seed"], json.dumps(r["config"]), str(sweep_dir / "runs" / r["run_id"])))
    return {row["run_id"]: row["status"] for row in db.execute("SELECT run_id, status FROM runs")}


def mark_running(db: sqlite3.Connection, run_id: str) -> None:
    with writing(db):
        db.execute("UPDATE runs SET status='running', started=?, error=NULL WHERE run_id=?", (time.time(), run_id))


def record_done(db: sqlite3.Connection, run_id: str, summary: dict, history: list[dict],
                environment: dict | None = None) -> None:
    """A finished run: its summary, its per-round scalars and where it ran (versions, threads,
    device, commit: ``fedskew.engine.rundir.environment``)."""
    with writing(db):
        db.execute("DELETE FROM rounds WHERE run_id=?", (run_id,))
        db.executemany("INSERT INTO rounds (run_id, round, metrics) VALUES (?, ?, ?)",
                       [(run_id, h["round"], json.dumps(h)) for h in history])
        db.execute("UPDATE runs SET status='done', summary=?, finished=?, environment=? WHERE run_id=?",
                   (json.dumps(summary), time.time(), json.dumps(environment) if environment else None, run_id))


def mark_interrupted(db: sqlite3.Connection, run_id: str) -> None:
    """A run stopped by a signal (its checkpoint kept): the next sweep resumes it."""
    with writing(db):
        db.execute("UPDATE runs SET status='interrupted', finished=NULL WHERE run_id=? AND status='running'",
                   (run_id,))


def record_failed(db: sqlite3.Connection, run_id: str, error: str) -> None:
    with writing(db):
        db.execute("UPDATE runs SET status='failed', error=?, finished=? WHERE run_id=?", (error, time.time(), run_id))


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass
class Run:
    label: str
    partition: str
    seed: int
    params: dict
    summary: dict
    history: list[dict]
    run_dir: Path


@dataclass
class Results:
    labels: list[str]
    partitions: list[str]
    runs: dict[tuple[str, str], list[Run]]  # (label, partition) -> the selected grid point's runs
    selections: dict[tuple[str, str], dict] = field(default_factory=dict)
    name: str = "sweep"
    spec: dict = field(default_factory=dict)
    failed: dict[tuple[str, str], int] = field(default_factory=dict)  # (label, partition) -> failed runs


def selections_of(db: sqlite3.Connection, spec: dict | None = None) -> dict[tuple[str, str], dict]:
    """(method label, partition) -> its ``selections`` row: the recorded one, else, for a sweep
    stopped before it recorded one (a sweep records its selection when its runs end, so a killed
    one has none), the selection its finished runs give now under ``spec`` (the sweep.yaml)."""
    rows = {(r["label"], r["partition"]): dict(r) for r in db.execute("SELECT * FROM selections")}
    if spec and spec.get("methods"):
        from fedskew.experiments.sweep import load_spec, select

        for key, chosen in select(db, load_spec(spec), record=False).items():
            rows.setdefault(key, chosen["row"])
    return rows


def selected_runs(db: sqlite3.Connection, spec: dict | None = None) -> Results:
    """The finished runs of the grid point chosen per (method label, partition), with their
    histories: what a report shows."""
    spec = spec or {}
    selections = selections_of(db, spec)
    labels = [m["label"] or m["name"] for m in spec.get("methods", [])] or \
        sorted({r["label"] for r in db.execute("SELECT label FROM runs")})
    partitions = list(spec.get("partitions", {})) or \
        sorted({r["partition"] for r in db.execute("SELECT partition FROM runs")})
    runs: dict[tuple[str, str], list[Run]] = {}
    failed: dict[tuple[str, str], int] = {}
    for row in db.execute("SELECT * FROM runs WHERE status IN ('done', 'failed') ORDER BY seed"):
        key = (row["label"], row["partition"])
        chosen = selections.get(key)
        if chosen is not None and chosen["params"] != row["params"]:
            continue
        if row["status"] == "failed":
            failed[key] = failed.get(key, 0) + 1
            continue
        history = [json.loads(m["metrics"]) for m in
                   db.execute("SELECT metrics FROM rounds WHERE run_id=? ORDER BY round", (row["run_id"],))]
        runs.setdefault(key, []).append(Run(row["label"], row["partition"], row["seed"], json.loads(row["params"]),
                                            json.loads(row["summary"]), history, run_dir_of(db, row["run_id"])))
    return Results(labels, partitions, runs, selections, spec.get("name", "sweep"), spec, failed)


def results_table(sweep_dir: str | Path, rounds: bool = False) -> list[dict]:
    """Every planned run of a sweep as one flat row (``fedskew.load_results``): ``run_id``,
    ``label``, ``method``, ``partition``, ``seed``, ``status``, ``selected`` (the grid point the
    selection chose for its method and partition), ``error``, ``run_dir``, the grid point's options
    as ``option/<name>``, and the summary's scalar values under their metric names. With
    ``rounds``: one row per finished run and round instead, with that round's scalar metrics."""
    db = open_sweep(sweep_dir)
    spec_path = Path(sweep_dir) / "sweep.yaml"
    try:
        spec = yaml.safe_load(spec_path.read_text()) if spec_path.is_file() else None
        chosen = {key: r["params"] for key, r in selections_of(db, spec).items()}
        rows = []
        for row in db.execute("SELECT * FROM runs ORDER BY rowid"):
            base = {"run_id": row["run_id"], "label": row["label"], "method": row["method"],
                    "partition": row["partition"], "seed": row["seed"], "status": row["status"],
                    "selected": chosen.get((row["label"], row["partition"])) == row["params"],
                    **{f"option/{k}": v for k, v in json.loads(row["params"]).items()}}
            if rounds:
                if row["status"] == "done":
                    rows += [{**base, **json.loads(m["metrics"])} for m in db.execute(
                        "SELECT metrics FROM rounds WHERE run_id=? ORDER BY round", (row["run_id"],))]
                continue
            summary = json.loads(row["summary"]) if row["summary"] else {}
            scalars = {k: v for k, v in summary.items() if v is None or isinstance(v, (int, float, str))}
            env = {f"env/{k}": v for k, v in json.loads(row["environment"] or "{}").items()}
            rows.append({**base, "error": row["error"], "run_dir": str(run_dir_of(db, row["run_id"])),
                         **{k: v for k, v in scalars.items() if k not in base}, **env})
        return rows
    finally:
        db.close()


__all__ = ["Results", "Run", "add_planned", "connect", "mark_interrupted", "mark_running", "open_sweep", "record_done",
           "record_failed", "results_table", "scalar_metrics", "selected_runs", "writable", "writing"]
