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
import re
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path

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
    from fedskew.files import open_file

    if os.path.lexists(path):  # a link, a FIFO or a device where the store goes: one sentence, never a hang
        open_file(path, "results database", own=True, limit=None).close()
        if not read_only and os.path.getsize(path) and not is_store(path):  # (a database of the user's: never
            raise ConfigError(f"'{path}' is not a fedskew results database (it has no runs table); move it away "
                              f"or use another sweep folder.")  # given fedskew's tables)
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


def clean_metrics(record: dict) -> dict:
    """A summary or a round's record as the tables read it: a metric (a key with a ``/``, such as
    ``global/test_acc``) is a finite number, a list of them (per-client values) or None (a diverged
    run's NaN, or an edited file's string or mapping, is no value; so is a non-finite entry of a list),
    ``rounds`` and ``seed`` an integer or None; other keys as they are."""
    from fedskew.files import finite_or_none

    out = {}
    for key, value in record.items():
        if "/" in str(key) and isinstance(value, list):
            value = [finite_or_none(v) for v in value] if all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value) else None
        elif "/" in str(key):
            value = finite_or_none(value)
            value = int(value) if value is not None and isinstance(record[key], int) else value
        elif key in ("rounds", "seed", "round"):
            value = value if isinstance(value, int) and not isinstance(value, bool) else None
        out[str(key)] = value
    return out


def cell(db: sqlite3.Connection, row: sqlite3.Row, column: str) -> dict:
    """A JSON column of a results-database row (``summary``, ``params``, ``config``, ``environment``,
    ``metrics``) as a mapping, read as untrusted (the file may come from elsewhere): NaN and Infinity
    as None, summaries and round records through :func:`clean_metrics`; a value that is not a JSON
    mapping is one sentence naming the database, the run and the column."""
    from fedskew.files import FileProblem

    text = row[column]
    if text is None:
        return {}
    run = f"run {row['run_id']}'s" if "run_id" in row.keys() else (
        f"method {row['label']}'s" if "label" in row.keys() else "a")
    try:
        value = json.loads(text, parse_constant=lambda name: None) if isinstance(text, (str, bytes)) else text
    except (ValueError, RecursionError):
        value = text
    if not isinstance(value, dict):
        raise FileProblem(f"results database '{database_path(db)}': {run} {column} is not a JSON mapping (the file "
                          f"was edited or damaged); run the sweep again in a new folder.")
    return clean_metrics(value) if column in ("summary", "metrics") else value


def database_path(db: sqlite3.Connection) -> str:
    row = db.execute("PRAGMA database_list").fetchone()
    return row[2] if row is not None and row[2] else "results.sqlite"


def is_store(path: Path) -> bool:
    """Whether ``path`` is a results database a sweep of fedskew wrote (a regular SQLite file with its
    ``runs`` table; one that another process holds locked now, a sweep writing it, counts: that sweep's
    folder lock then answers), read without writing anything."""
    if not Path(path).is_file() or Path(path).is_symlink():
        return False
    try:
        with open(path, "rb") as fh:
            if fh.read(16) != b"SQLite format 3\x00":
                return False
        db = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True, timeout=1.0)
        try:
            return db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='runs'").fetchone() is not None
        finally:
            db.close()
    except sqlite3.OperationalError as exc:
        return "locked" in str(exc) or "busy" in str(exc)
    except (OSError, sqlite3.Error):
        return False


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

        parts = (
            sorted(q.parent.name for q in Path(sweep_dir).glob("*/results.sqlite")) if Path(sweep_dir).is_dir() else []
        )
        if parts:  # a bench folder: its parts are the sweeps
            raise ConfigError(f"'{sweep_dir}' is a bench folder, whose parts are sweeps: report one of them "
                              f"({', '.join(str(Path(sweep_dir) / q) for q in parts)}), or rebuild its leaderboard "
                              f"with `fedskew bench SUITE --scale SCALE --out {sweep_dir} --report`.")
        raise ConfigError(f"'{sweep_dir}' is not a sweep folder (it holds no results.sqlite).")
    return connect(path, read_only=not writable(sweep_dir))


def writable(sweep_dir: str | Path) -> bool:
    """Whether this process may write the sweep folder and its database (False on a read-only
    mount, where even root may not)."""
    path = Path(sweep_dir) / "results.sqlite"
    return os.access(path.parent, os.W_OK) and (not path.exists() or os.access(path, os.W_OK))


def run_dir_of(db: sqlite3.Connection, run_id: str) -> Path:
    """A run's directory, found beside the database (``runs/<id>``) wherever the sweep folder is
    now and whatever the working directory was when it ran. A run id is the 12 hexadecimal digits a
    sweep gives it: anything else in a database (``../x``, an absolute path) names no folder of it."""
    from fedskew.config import ConfigError

    where = Path(db.execute("PRAGMA database_list").fetchone()[2])
    if not isinstance(run_id, str) or not re.fullmatch(r"[0-9a-f]{12}", run_id):
        raise ConfigError(f"'{where}' names run id {str(run_id)[:40]!r}, which is not a sweep's (12 hexadecimal "
                          f"digits); the database was not written by fedskew as it is.")
    return where.parent / "runs" / run_id


def scalar_metrics(record: dict) -> dict:
    """The per-round values worth keeping in the database (numbers and none; no per-client lists)."""
    return {k: v for k, v in record.items() if v is None or isinstance(v, (int, float))}


# ---------------------------------------------------------------------------------------------
# Writing (the sweep process only)


def add_planned(db: sqlite3.Connection, runs: list[dict], sweep_dir: Path) -> dict[str, str]:
    """Insert the planned runs not yet in the database as ``pending``; every run's status. A row
    of the same method label, grid point, partition and seed under another run id (its config or,
    for a method of the user's, its module's source changed since: ``spec.plan``) becomes
    ``superseded``: kept, never selected or reported (fedskew before 2026-11-27 averaged both)."""
    with writing(db):
        for r in runs:
            params = json.dumps(r["params"], sort_keys=True)
            db.execute("INSERT OR IGNORE INTO runs (run_id, label, method, params, partition, seed, status, config, "
                       "run_dir) VALUES (?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
                       (r["run_id"], r["label"], r["method"], params, r["partition"],
                        r["seed"], json.dumps(r["config"]), str(sweep_dir / "runs" / r["run_id"])))
            db.execute("UPDATE runs SET status='superseded' WHERE label=? AND params=? AND partition=? AND seed=? "
                       "AND run_id != ? AND status != 'superseded'",
                       (r["label"], params, r["partition"], r["seed"], r["run_id"]))
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


__all__ = ["add_planned", "connect", "mark_interrupted", "mark_running", "open_sweep", "record_done", "record_failed",
           "run_dir_of", "scalar_metrics", "writable", "writing"]
