"""Hyper-parameter selection and what it chose: per (method label, partition) the grid point with
the best mean over seeds of the selection metric (:func:`select`, recorded in the results store's
``selections``), and the finished runs of the chosen points (:func:`selected_runs`, what reports
show; :func:`results_table`, every run as one row with ``selected``).
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from fedskew.experiments.spec import SweepSpec, grid_points, load_spec, planned_points, read_record, tune_seeds
from fedskew.experiments.store import cell, open_sweep, run_dir_of, writing

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
                                                                                cell(db, row, "summary")))
    groups: dict[tuple[str, str], dict[str, list[float]]] = {}
    used: dict[tuple[str, str], str] = {}
    for group, found in summaries.items():
        # no run of the group has a global model: its personal models on the hold-out choose
        personal = spec.selection.split == "validation" and all(s.get(metric) is None for _, s in found) and \
            any(s.get(PERSONAL_VALIDATION) is not None for _, s in found)
        key = used[group] = PERSONAL_VALIDATION if personal else metric
        for params, s in found:
            bucket = groups.setdefault(group, {}).setdefault(params, [])
            if s.get(key) is not None:  # (a number: clean_metrics)
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
    shown = set(labels)
    for row in db.execute("SELECT * FROM runs WHERE status IN ('done', 'failed') ORDER BY seed"):
        key = (row["label"], row["partition"])
        if key[0] not in shown:  # a method the spec no longer (or does not) name
            continue
        chosen = selections.get(key)
        if chosen is not None and chosen["params"] != row["params"]:
            continue
        if row["status"] == "failed":
            failed[key] = failed.get(key, 0) + 1
            continue
        history = [cell(db, m, "metrics") for m in
                   db.execute("SELECT run_id, metrics FROM rounds WHERE run_id=? ORDER BY round", (row["run_id"],))]
        runs.setdefault(key, []).append(Run(row["label"], row["partition"], row["seed"], cell(db, row, "params"),
                                            cell(db, row, "summary"), history, run_dir_of(db, row["run_id"])))
    return Results(labels, partitions, runs, selections, spec.get("name", "sweep"), spec, failed)


def results_table(sweep_dir: str | Path, rounds: bool = False) -> list[dict]:
    """Every planned run of a sweep as one flat row (``fedskew.load_results``): ``run_id``,
    ``label``, ``method``, ``partition``, ``seed``, ``status``, ``selected`` (the grid point the
    selection chose for its method and partition), ``error``, ``run_dir``, the grid point's options
    as ``option/<name>``, and the summary's scalar values under their metric names. With
    ``rounds``: one row per finished run and round instead, with that round's scalar metrics."""
    db = open_sweep(sweep_dir)
    try:
        spec = read_record(sweep_dir) or None
        chosen = {key: r["params"] for key, r in selections_of(db, spec).items()}
        rows = []
        for row in db.execute("SELECT * FROM runs ORDER BY rowid"):
            base = {"run_id": row["run_id"], "label": row["label"], "method": row["method"],
                    "partition": row["partition"], "seed": row["seed"], "status": row["status"],
                    "selected": chosen.get((row["label"], row["partition"])) == row["params"],
                    **{f"option/{k}": v for k, v in cell(db, row, "params").items()}}
            if rounds:
                if row["status"] == "done":
                    rows += [{**base, **cell(db, m, "metrics")} for m in db.execute(
                        "SELECT run_id, metrics FROM rounds WHERE run_id=? ORDER BY round", (row["run_id"],))]
                continue
            summary = cell(db, row, "summary")
            scalars = {k: v for k, v in summary.items() if v is None or isinstance(v, (int, float, str))}
            env = {f"env/{k}": v for k, v in cell(db, row, "environment").items()}
            rows.append({**base, "error": row["error"], "run_dir": str(run_dir_of(db, row["run_id"])),
                         **{k: v for k, v in scalars.items() if k not in base}, **env})
        return rows
    finally:
        db.close()


__all__ = ["PERSONAL_VALIDATION", "Results", "Run", "TIE_TOLERANCE", "results_table", "select", "selected_runs",
           "selections_of"]
