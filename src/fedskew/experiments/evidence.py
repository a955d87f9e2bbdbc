"""The per-run results behind a table that a page quotes, and the table rebuilt from them.

A table in README or in the documentation that quotes a sweep's numbers is never typed: the sweep's
runs are exported once (:func:`export_runs`, one JSON line per planned run: the rows of
``fedskew.load_results`` without local paths), committed beside the page, and the table is rebuilt
from that file (:func:`front_table`) between two markers in the page::

    <!-- generated from docs/evidence/sweep-digits.jsonl: do not edit -->
    ...
    <!-- end generated -->

``python benchmarks/front_page.py SWEEP_DIR`` exports a sweep and rewrites every such block; a test
rebuilds each block from the committed file and fails when the page says anything else.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from fedskew.experiments.report import bold_labels, chance_of, mean_std

LOCAL = ("run_dir",)  # where a run lay on the machine that ran it: not evidence
BLOCK = re.compile(r"(<!-- generated from (?P<source>\S+)(?P<args>[^>]*?): do not edit -->\n)(?P<body>.*?)"
                   r"(<!-- end generated -->)", re.S)


def export_runs(sweep_dir: str | Path, path: str | Path) -> list[dict]:
    """Write ``sweep_dir``'s runs to ``path`` as JSON lines (sorted keys, one run a line); returns them."""
    from fedskew.engine.durable import atomic_write_text
    from fedskew.experiments.selection import results_table

    rows = [{k: v for k, v in r.items() if k not in LOCAL} for r in results_table(sweep_dir)]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), Path(path))
    return rows


def read_runs(path: str | Path) -> list[dict]:
    """The runs :func:`export_runs` wrote; a line that is not a JSON object is one sentence."""
    from fedskew.files import FileProblem, parse_json, read_text

    rows = []
    for i, line in enumerate(read_text(path, "exported runs").splitlines(), 1):
        if not line.strip():
            continue
        row = parse_json(line, f"{path}, line {i}", "exported run")
        if not isinstance(row, dict) or not {"label", "partition", "seed", "status"} <= set(row):
            raise FileProblem(f"exported runs '{path}', line {i}, is not a run of fedskew's export (an object "
                              f"with label, partition, seed and status).")
        rows.append(row)
    return rows


def cells(rows: list[dict], metric: str) -> dict[tuple[str, str], dict[int, float]]:
    """(partition, label) -> {seed: value of ``metric``} over the finished runs the selection chose."""
    out: dict[tuple[str, str], dict[int, float]] = {}
    for r in rows:
        if r["status"] == "done" and r.get("selected", True):
            value = r.get(metric)
            if isinstance(value, (int, float)):
                out.setdefault((r["partition"], r["label"]), {})[int(r["seed"])] = float(value)
    return out


def labels_of(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["label"] for r in rows))


def _header(rows: list[dict], label: str, partition: str, names: dict[str, str]) -> str:
    """A column's name, with the options its selection chose where the method had a grid."""
    mine = [r for r in rows if r["label"] == label and r["partition"] == partition]
    chosen = next((r for r in mine if r.get("selected")), {})
    grid = sorted({k for r in mine for k in r if k.startswith("option/")})
    varied = [k for k in grid if len({json.dumps(r.get(k)) for r in mine}) > 1]
    said = ", ".join(f"{k.split('/', 1)[1]} {chosen.get(k)}" for k in varied)
    return names.get(label, label) + (f" ({said})" if said else "")


def front_table(rows: list[dict], metrics: list[tuple[str, str]], names: dict[str, str] | None = None,
                partition: str | None = None) -> str:
    """A markdown table of one partition: a row per ``(metric, title)``, a column per method (its
    display name from ``names``), each cell mean +- std over seeds in percent, bold the top group
    (:func:`fedskew.experiments.report.bold_labels`, the rule of every table fedskew prints)."""
    names = names or {}
    labels = labels_of(rows)
    partition = partition or rows[0]["partition"]
    dataset = next((r.get("dataset") for r in rows if r.get("dataset")), None)
    heads = [_header(rows, c, partition, names) for c in labels]
    lines = [f"| {partition} on {dataset} (%) | " + " | ".join(heads) + " |",
             "|---|" + "---|" * len(labels)]
    for key, title in metrics:
        values = {c: v for (p, c), v in cells(rows, key).items() if p == partition}
        top = bold_labels(values, chance_of(dataset, key))
        out = []
        for c in labels:
            mean, std, n = mean_std(list(values.get(c, {}).values()))
            text = "none" if mean is None else f"{100 * mean:.2f} +- {100 * std:.2f}"
            out.append(f"**{text}**" if c in top else text)
        lines.append(f"| {title} | " + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"


def bold_sentence(rows: list[dict], metrics: list[tuple[str, str]], names: dict[str, str] | None = None,
                  partition: str | None = None) -> str:
    """Which methods each row of :func:`front_table` bolds, as a sentence."""
    names = names or {}
    partition = partition or rows[0]["partition"]
    dataset = next((r.get("dataset") for r in rows if r.get("dataset")), None)
    labels = labels_of(rows)
    parts = []
    for key, title in metrics:
        top = bold_labels({c: v for (p, c), v in cells(rows, key).items() if p == partition}, chance_of(dataset, key))
        who = [names.get(c, c) for c in labels if c in top]
        said = ("none" if not who else "all of them" if len(who) == len(labels) else
                who[0] if len(who) == 1 else ", ".join(who[:-1]) + " and " + who[-1])
        parts.append(f"{title}: {said}")
    return "Bold here: " + "; ".join(parts) + ".\n"


def environment(rows: list[dict]) -> str:
    """Where the runs ran, from their recorded environment: commit, torch, device, CPU, threads."""
    r = next((r for r in rows if r["status"] == "done"), rows[0])
    commit = str(r.get("env/git_commit") or "unknown")[:12]
    return (f"fedskew {commit}, torch {r.get('env/torch', '?')}, {r.get('env/device', '?')}, "
            f"{r.get('env/cpu', '?')}, {r.get('env/torch_threads', '?')} torch thread(s)")


def measured(path: Path, kind: str) -> str:
    """A sentence from a benchmark's record (benchmarks/common.py's ``write_result``): ``suite-time``
    gives the suite's wall times with the machine and date they were measured on."""
    from fedskew.files import read_json

    if kind != "suite-time":
        raise ValueError(f"generated block from {path}: unknown kind '{kind}' (suite-time)")
    if not path.exists():
        return "not measured yet (benchmarks/suite_time.py measures it)\n"
    record = read_json(path, "benchmark record")
    times = {row[0]: row[1] for row in record["rows"]}
    return (f"the full suite took {times.get('full suite', '?')} and the fast subset {times.get('fast subset', '?')} "
            f"(minutes:seconds) on {record['hardware']}, {record['date']}\n")


KINDS = {"table": front_table, "bold": bold_sentence}
FRONT_METRICS = [("global/test_acc_mean_last10", "global, mean of the last 10 rounds"),
                 ("personal/final_acc_after", "personalised, every client after one local pass")]
FRONT_NAMES = {"fedavg": "FedAvg", "fedmr": "FedMR", "map": "MAP", "etf_gmv": "ETF+GMV", "fedka": "FedKA",
               "fedprox": "FedProx", "logitnorm": "LogitNorm"}


def render_block(source: str, args: str, root: Path) -> str:
    """The body of one generated block: ``args`` is ``kind`` then ``key=value`` words (``table``,
    ``bold`` or ``environment``; ``metrics=front``)."""
    words = args.split()
    kind = words[0] if words else "table"
    if source.endswith(".json"):
        return measured(root / source, kind)
    rows = read_runs(root / source)
    if kind == "environment":
        return environment(rows) + "\n"
    if kind not in KINDS:
        raise ValueError(f"generated block from {source}: unknown kind '{kind}' (table, bold or environment)")
    return KINDS[kind](rows, FRONT_METRICS, FRONT_NAMES)


def refresh(text: str, root: Path, only: str | None = None) -> str:
    """``text`` with every generated block rebuilt from its source (paths relative to ``root``);
    ``only``: the blocks of that source alone."""
    def block(m: re.Match) -> str:
        if only is not None and m.group("source") != only:
            return m.group(0)
        return m.group(1) + render_block(m.group("source"), m.group("args"), root) + m.group(5)

    return BLOCK.sub(block, text)


__all__ = ["bold_sentence", "cells", "environment", "export_runs", "front_table", "read_runs", "refresh"]
