"""``fedskew bench``: suites of the papers' settings run as sweeps, with the published numbers of the
registry (:mod:`fedskew.experiments.published`) beside ours.

A suite is a list of papers; each paper's reproduction preset (:mod:`fedskew.experiments.presets`)
gives its sweep at a scale, and its registry files give the published numbers. A run group
(method label x partition label) is linked to the published entries of the same paper whose
method is the label's method with no options beyond the preset's, whose setting label is the
partition label, and whose setting's data set is the paper's reference data set at that scale.

Scales: ``smoke`` (the bundled digits, a few rounds, one seed: the pipeline, seconds a cell),
``lite`` (Fashion-MNIST at CPU scale: the presets' ``small``), ``paper`` (the published setting as
far as the registry's ``differs`` notes allow; a GPU or a cluster). Every table says its scale; a
smoke or lite cell is never compared as if it were the paper's setting: its delta is printed, but
labelled as what it is.

Built so far (issue 31, first part): the ``seed-papers`` suite for FedMR (Table 1, FMNIST and
CIFAR-10 rows) and MAP (Tables I and II, FaMnist MLPNet), and ``niid-bench`` (NIID-Bench's label
skew on Fashion-MNIST, and on CIFAR-10 at paper scale) beside the numbers Flower's port of it
reports. Not yet: the ``label-skew`` suite, tuning under one budget on validation, ranks and paired
tests, HTML.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from fedskew.config import ConfigError, did_you_mean
from fedskew.experiments.published import Entry, load

SCALES = {"smoke": "smoke", "lite": "small", "paper": "paper"}  # bench scale -> preset scale
# the registry files of each part of a suite, and the data set whose published numbers a scale is
# placed beside
PAPERS = {
    "fedmr": {"files": ("fedmr.yaml",), "reference": {"smoke": "fmnist", "lite": "fmnist", "paper": "cifar10"}},
    "map": {"files": ("map_table1.yaml", "map_table2.yaml"),
            "reference": {"smoke": "fmnist", "lite": "fmnist", "paper": "fmnist"}},
    "niid-fmnist": {"files": ("niid_bench_flower.yaml",),
                    "reference": {"smoke": "fmnist", "lite": "fmnist", "paper": "fmnist"}},
    "niid-cifar10": {"files": ("niid_bench_flower.yaml",),
                     "reference": {"smoke": "cifar10", "lite": "cifar10", "paper": "cifar10"}},
}
SUITES = {
    "seed-papers": {"papers": ("fedmr", "map"),
                    "about": "the seed papers' main tables: FedMR Table 1, MAP Tables I and II"},
    "niid-bench": {"papers": ("niid-fmnist", "niid-cifar10"),
                   "about": "NIID-Bench's label skew (IID, Dir(0.5), #C=1/2/3; FedAvg, SCAFFOLD, FedProx, FedNova)"},
}
NIID_PARTITIONS = {"IID": {"name": "iid"}, "Dir0.5": {"name": "dirichlet", "alpha": 0.5},
                   "#C=1": {"name": "label_k", "classes_per_client": 1},
                   "#C=2": {"name": "label_k", "classes_per_client": 2},
                   "#C=3": {"name": "label_k", "classes_per_client": 3}}


def niid_bench(dataset: str, scale: str, data_root: str | None) -> dict | None:
    """NIID-Bench's protocol (10 clients, all every round, simple CNN, E = 10, B = 64, lr 0.01,
    momentum 0.9, ToTensor pixels, 50 rounds) on ``dataset``; lite: 10% of the training set, 20
    rounds of E = 2; smoke: digits, 3 rounds of E = 1, one seed. CIFAR-10 only at paper scale
    (None otherwise: the lite suite is what a CPU finishes)."""
    if dataset == "cifar10" and scale != "paper":
        return None
    data = {"name": dataset, "normalize": False, **({"root": data_root} if data_root else {})}
    base = {"dataset": data, "model": "simplecnn", "partition": {"num_clients": 10, "local_test_fraction": 0.0},
            "clients_per_round": 10, "rounds": 50, "local_epochs": 10, "batch_size": 64, "lr": 0.01, "momentum": 0.9,
            "final_personalization": False}
    seeds = [0, 1, 2]
    if scale == "lite":
        base.update({"dataset": {**data, "train_subsample": 0.1}, "rounds": 20, "local_epochs": 2,
                     "executor": "vectorized"})
    elif scale == "smoke":
        base.update({"dataset": "digits", "model": {"name": "mlp", "hidden": [64]}, "rounds": 3, "local_epochs": 1,
                     "batch_size": 16})
        seeds = [0]
    return {"name": f"niid-bench {dataset}", "base": base, "partitions": NIID_PARTITIONS, "seeds": seeds,
            "methods": ["fedavg", "scaffold", "fedprox", "fednova"],
            "report": {"metric": "global/test_acc", "baseline": "fedavg"}}
SCALE_NOTE = {"smoke": "smoke: bundled digits, a few rounds, one seed; the published values are the paper's "
                       "setting, not this one: the deltas check the pipeline, not the method",
              "lite": "lite: Fashion-MNIST subsampled, fewer rounds (the presets' small scale); the published "
                      "values are the paper's full setting: not a reproduction",
              "paper": "paper: the published setting (keys that differ are listed under each table)"}


def suite_names() -> list[str]:
    return sorted(SUITES)


def check_suite(name: str, scale: str) -> None:
    if name not in SUITES:
        raise ConfigError(f"bench suite '{name}' is not known{did_you_mean(name, SUITES)}; `fedskew bench --list` "
                          f"lists them: {', '.join(suite_names())}.")
    if scale not in SCALES:
        raise ConfigError(f"bench --scale '{scale}' is not allowed; use one of {', '.join(SCALES)}.")


def sweeps(name: str, scale: str, data_root: str | None = None) -> dict[str, dict]:
    """paper -> the sweep spec (a mapping) of that paper's part of the suite at ``scale``."""
    from fedskew.experiments.presets import reproduction

    check_suite(name, scale)
    out = {}
    for paper in SUITES[name]["papers"]:
        if paper.startswith("niid-"):
            spec = niid_bench(paper.split("-", 1)[1], scale, data_root)
            if spec is None:
                continue
        else:
            spec = reproduction(paper, SCALES[scale], data_root)
        spec["name"] = f"bench {name} {paper} {scale}"
        out[paper] = spec
    return out


def suite_dir(name: str, scale: str, out: str | Path | None = None) -> Path:
    return Path(out) if out is not None else Path("runs") / f"bench-{name}-{scale}"


def listing() -> list[dict]:
    """Every suite with its size per scale: papers, runs, published entries linked."""
    from fedskew.experiments.sweep import load_spec, plan

    entries = load()
    rows = []
    for name, suite in SUITES.items():
        for scale in SCALES:
            runs = sum(len(plan(load_spec(spec))) for spec in sweeps(name, scale, "DATA").values())
            published = sum(1 for e in entries if any(e.file in PAPERS[p]["files"] for p in suite["papers"]))
            rows.append({"suite": name, "scale": scale, "papers": ", ".join(suite["papers"]), "runs": runs,
                         "published": published, "about": suite["about"]})
    return rows


@dataclass
class Cell:
    """One (paper, table, setting, method) line of the leaderboard."""

    paper: str
    entry: Entry
    ours: list[float]

    @property
    def mean(self) -> float | None:
        return 100 * statistics.fmean(self.ours) if self.ours else None

    @property
    def std(self) -> float | None:
        return 100 * statistics.stdev(self.ours) if len(self.ours) > 1 else None

    @property
    def delta(self) -> float | None:
        return None if self.mean is None else self.mean - self.entry.value

    @property
    def within(self) -> bool | None:
        """Whether our mean lies within the published spread (None: the paper gives none)."""
        if self.mean is None or self.entry.spread is None:
            return None
        return abs(self.delta) <= self.entry.spread


def leaderboard(name: str, scale: str, out: str | Path | None = None) -> list[Cell]:
    """Our finished runs of the suite at ``scale`` beside the linked published entries."""
    from fedskew.experiments.store import results_table

    check_suite(name, scale)
    entries = load()
    folder = suite_dir(name, scale, out)
    cells = []
    for paper in sweeps(name, scale, "DATA"):
        sweep_dir = folder / paper
        rows = results_table(sweep_dir) if (sweep_dir / "results.sqlite").exists() else []
        dataset = PAPERS[paper]["reference"][scale]
        for e in entries:
            if e.file not in PAPERS[paper]["files"] or e.options or _dataset(e) != dataset:
                continue
            ours = [r[e.metric.key] for r in rows if r.get("label") == e.method and r.get("partition") == e.setting.label
                    and r.get("status") == "done" and r.get("selected", True) and r.get(e.metric.key) is not None
                    and not (isinstance(r.get(e.metric.key), float) and math.isnan(r[e.metric.key]))]
            cells.append(Cell(paper, e, ours))
    return cells


def _dataset(e: Entry) -> str:
    d = e.setting.config.get("dataset")
    return d["name"] if isinstance(d, dict) else d


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(name: str, scale: str, cells: list[Cell], command: str) -> str:
    """The leaderboard as Markdown: one table per (registry table, setting), ours beside published."""
    lines = [f"# fedskew bench {name} ({scale})", "", f"Scale: {SCALE_NOTE[scale]}.", "",
             f"Rebuild: `{command}`. Ours: mean +- std over the seeds that finished (percent); published: the "
             f"paper's value (its spread, see each table); delta = ours - published; 'within' = |delta| <= the "
             f"published spread.", ""]
    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.paper, c.entry.file, c.entry.setting_id), []).append(c)
    for (paper, file, setting), group in groups.items():
        e0 = group[0].entry
        lines += [f"## {paper}: {e0.source.table}, {setting} ({e0.metric.key})", "",
                  f"{e0.source.paper}, {e0.source.venue}. Metric: {e0.metric.meaning}."
                  + (f" Published spread: {e0.spread_meaning}." if e0.spread_meaning else ""), ""]
        if e0.setting.differs:
            lines += ["Setting keys that differ from the paper: " + "; ".join(f"`{k}`: {v}" for k, v in
                                                                              e0.setting.differs.items()) + ".", ""]
        lines += ["| method | ours | seeds | published | delta | within | source |", "|---|---|---|---|---|---|---|"]
        for c in sorted(group, key=lambda c: -(c.mean if c.mean is not None else -1)):
            ours = "not run" if c.mean is None else f"{c.mean:.2f}" + (f" +- {c.std:.2f}" if c.std is not None else "")
            pub = f"{c.entry.value:.2f}" + (f" ({c.entry.spread:.2f})" if c.entry.spread is not None else "")
            within = "-" if c.within is None else ("yes" if c.within else "no")
            lines.append(f"| {c.entry.method} | {ours} | {len(c.ours)} | {pub} | {_fmt(c.delta)} | {within} | "
                         f"{c.entry.cite} |")
        lines.append("")
    return "\n".join(lines)


__all__ = ["Cell", "PAPERS", "SCALES", "SUITES", "leaderboard", "listing", "markdown", "suite_dir", "sweeps"]
