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

Suites: ``seed-papers`` (FedMR Table 1, MAP Tables I and II), ``niid-bench`` (NIID-Bench's label
skew beside the numbers Flower's port reports) and ``label-skew`` (every registered method under
#C=1, #C=2, Dir(0.1), Dir(0.5), PxCy and C-K-n, global and personalised accuracy, each method tuned
under one budget on a validation split: :func:`trials`). The leaderboard (:func:`write_leaderboard`,
Markdown and HTML) gives per part a methods x settings table (mean +- std over seeds, rank per
setting, average rank, win/tie/loss against FedAvg by a paired t-test over seeds), the budget and the
values each method's selection chose, and the published numbers beside ours where a registry entry
is linked.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import random
import re
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from fedskew.config import ConfigError, did_you_mean
from fedskew.experiments.published import Entry, load
from fedskew.experiments.report import BOLD_RULE, SIGNIFICANCE, bold_labels, chance_of, paired_test
from fedskew.experiments.selection import PERSONAL_VALIDATION

SCALES = {"smoke": "smoke", "lite": "lite", "paper": "paper"}  # bench scale -> preset scale
# the registry files of each part of a suite, and the data set whose published numbers a scale is
# placed beside
PAPERS = {
    "fedmr": {"files": ("fedmr.yaml",), "reference": {"smoke": "fmnist", "lite": "fmnist", "paper": "cifar10"}},
    "map": {"files": ("map_table1.yaml", "map_table2.yaml"),
            "reference": {"smoke": "fmnist", "lite": "fmnist", "paper": "fmnist"}},
    # published on CIFAR only: linked at paper scale
    "etf": {"files": ("etf_table1.yaml",), "reference": {"paper": "cifar10"}},
    "fedka": {"files": ("fedka_table1.yaml",), "reference": {"paper": "cifar10"}},
    "niid-fmnist": {"files": ("niid_bench_flower.yaml",),
                    "reference": {"smoke": "fmnist", "lite": "fmnist", "paper": "fmnist"}},
    "niid-cifar10": {"files": ("niid_bench_flower.yaml", "niid_bench_repo.yaml"),
                     "reference": {"smoke": "cifar10", "lite": "cifar10", "paper": "cifar10"}},
    # our own suite: no paper ran these methods on these settings, so nothing is linked
    "label-skew-fmnist": {"files": (), "reference": {}},
    "label-skew-cifar10": {"files": (), "reference": {}},
}
SUITES = {
    "seed-papers": {"papers": ("fedmr", "map", "etf", "fedka"),
                    "about": "the seed papers' main tables: FedMR Table 1, MAP Tables I and II, the neural-collapse "
                             "paper's Tables 1 and 2, FedKA Tables 1 and 8"},
    "niid-bench": {"papers": ("niid-fmnist", "niid-cifar10"),
                   "about": "NIID-Bench's label skew (IID, Dir(0.5), #C=1/2/3; FedAvg, SCAFFOLD, FedProx, FedNova)"},
    "label-skew": {"papers": ("label-skew-fmnist", "label-skew-cifar10"),
                   "about": "every registered method under #C=1, #C=2, Dir(0.1), Dir(0.5), PxCy, C-K-n and Dir(0.5) "
                            "with 20% of the clients never trained on; global, personalised and unseen-client "
                            "accuracy; each tuned on validation under one budget"},
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
    data = {"name": dataset, "normalize": False, **({"root": data_root} if data_root else {}),
            **({"augment": True} if dataset == "cifar10" else {})}  # NIID-Bench's crop and flip (registry: differs)
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
# ---------------------------------------------------------------------------------------------
# The label-skew suite: every method, tuned under one budget


BUDGET = {"smoke": 2, "lite": 3, "paper": 3}  # trials per method and setting, on the tuning seed
LR_FACTORS = (1 / 3, 1.0, 3.0)  # the learning rates every method may draw: the base lr times these


def trials(method: str, budget: int, lr: float) -> list[dict]:
    """The points a method is tried at: its defaults at the base ``lr`` first, then ``budget - 1``
    points drawn without replacement (a fixed draw per method name) from its search space
    (:func:`fedskew.algorithms.base.search_space`) x the learning rates ``lr * LR_FACTORS``. Every
    method gets the same number (FedAvg: its three learning rates); a method with no global model
    is chosen by its personal models on the validation hold-out (``selection.PERSONAL_VALIDATION``)."""
    from fedskew.algorithms import registered
    from fedskew.algorithms.base import search_space

    cls = registered()[method]
    space = search_space(cls.Options)
    fields = cls.Options.model_fields  # (the defaults without building the Options' validator)
    first = {**{k: fields[k].get_default(call_default_factory=True) for k in space}, "lr": lr}
    lrs = [round(lr * f, 8) for f in LR_FACTORS]
    keys = sorted(space)
    points = [{**dict(zip(keys, combo)), "lr": r} for combo in itertools.product(*(space[k] for k in keys))
              for r in lrs]
    others = [p for p in points if p != first]
    random.Random(f"fedskew-bench-{method}").shuffle(others)
    return [first, *others[:budget - 1]]


def suite_method(method: str, budget: int, base: dict) -> dict:
    """A method's entry in a suite: its :func:`trials` around the suite's ``base`` lr, under the
    suite's common local optimiser; a method whose optimiser is its own (``Method.own_optimiser``:
    FedCM's and GHBM's client momentum replaces SGD's) keeps its ``run_defaults``' momentum, and its
    trials are taken around its own lr (the suite's momentum 0.9 on top of theirs diverges)."""
    from fedskew.algorithms import registered

    cls = registered()[method]
    if not cls.own_optimiser:
        return {"name": method, "trials": trials(method, budget, base["lr"])}
    own = cls.run_defaults
    return {"name": method, "trials": trials(method, budget, own.get("lr", base["lr"])),
            "config": {k: own[k] for k in ("momentum",) if k in own}}


LABEL_SKEW_LR = {"smoke": 0.05, "lite": 0.01, "paper": 0.01}  # the suite's base local lr


UNSEEN = "Dir0.5-U20"  # the setting with clients never trained on


def label_skew_partitions(num_clients: int, samples_per_class: int) -> dict[str, dict]:
    """The label-skew settings of the suite on ``num_clients`` clients: six partitions, and
    :data:`UNSEEN`, Dir(0.5) with 20% of the clients held out of training (never sampled), which
    the ``unseen/*`` metrics score: the final model on their local test splits and each method's
    personalisation pass (PFLlib's new clients, FL-bench's split by user)."""
    return {"#C=1": {"name": "label_k", "classes_per_client": 1},
            "#C=2": {"name": "label_k", "classes_per_client": 2},
            "Dir0.1": {"name": "dirichlet", "alpha": 0.1},
            "Dir0.5": {"name": "dirichlet", "alpha": 0.5},
            f"P{num_clients}C2": {"name": "pcdd", "classes_per_client": 2},
            f"C-{num_clients}-2": {"name": "label_count", "classes_per_client": 2,
                                   "samples_per_class": samples_per_class},
            UNSEEN: {"name": "dirichlet", "alpha": 0.5, "held_out": 0.2}}


def label_skew(dataset: str, scale: str, data_root: str | None, methods: list[str] | None = None) -> dict | None:
    """Every registered method (or ``methods``) on ``dataset`` under the seven settings, tuned on a
    10% validation hold-out of the training set: ``BUDGET[scale]`` trials on seed 0, the selected
    point then on seeds 1 and 2. 20% of every client's data is its local test set (personalised
    accuracy, after one final local pass of every client).

    paper: the full training set, 20 clients, half of them per round, 100 rounds of E = 5, B = 64,
    SimpleCNN, base lr 0.01 with momentum 0.9. lite: Fashion-MNIST only, 10% of the training set
    (20% of the test set), an MLP 200-200, 20 rounds of E = 2. smoke: digits, 10 clients, 3 rounds,
    one seed. CIFAR-10 only at paper scale."""
    from fedskew.algorithms import registered

    if dataset == "cifar10" and scale != "paper":
        return None
    names = sorted(registered()) if methods is None else methods
    data = {"name": dataset, **({"root": data_root} if data_root else {})}
    base = {"dataset": data, "model": "simplecnn", "partition": {"num_clients": 20, "local_test_fraction": 0.2},
            "clients_per_round": 10, "rounds": 100, "local_epochs": 5, "batch_size": 64, "lr": LABEL_SKEW_LR[scale],
            "momentum": 0.9, "executor": "vectorized", "checkpoint_every": 10}
    clients, per_class, seeds = 20, 500, [0, 1, 2]
    if scale == "lite":
        base.update({"dataset": {**data, "train_subsample": 0.1, "test_subsample": 0.2},
                     "model": {"name": "mlp", "hidden": [200, 200]}, "rounds": 20, "local_epochs": 2})
        per_class = 50
    elif scale == "smoke":
        base.update({"dataset": "digits", "model": {"name": "mlp", "hidden": [64]},
                     "partition": {"num_clients": 10, "local_test_fraction": 0.2}, "clients_per_round": 5,
                     "rounds": 3, "local_epochs": 1, "batch_size": 16})
        clients, per_class, seeds = 10, 20, [0]
    return {"name": f"label-skew {dataset}", "base": base, "partitions": label_skew_partitions(clients, per_class),
            "seeds": seeds, "methods": [suite_method(m, BUDGET[scale], base) for m in names],
            "selection": {"split": "validation", "validation_fraction": 0.1, "tune_seeds": [0]},
            "report": {"metric": "global/test_acc_mean_last10", "baseline": "fedavg"}}


SCALE_NOTE = {"smoke": "smoke: bundled digits, a few rounds, one seed; the published values are the paper's "
                       "setting, not this one: the deltas check the pipeline, not the method",
              "lite": "lite: Fashion-MNIST subsampled, fewer rounds (the presets' small scale); the published "
                      "values are the paper's full setting: not a reproduction",
              "paper": "paper: the published setting (keys that differ are listed under each table)"}


LABEL_SKEW_NOTE = {"smoke": "smoke: bundled digits, 10 clients, 3 rounds, 2 trials, one seed: checks the pipeline",
                   "lite": "lite: Fashion-MNIST, 10% of the training set (a 10% validation hold-out of it) and 20% "
                           "of the test set, MLP 200-200, 20 clients (10 per round), 20 rounds of E = 2, B = 64, "
                           "3 trials per method on seed 0, the chosen one on seeds 0, 1, 2",
                   "paper": "paper: the full training set (10% held out for validation), SimpleCNN, 20 clients "
                            "(10 per round), 100 rounds of E = 5, B = 64, 3 trials on seed 0, the chosen one on "
                            "seeds 0, 1, 2"}


def label_skew_note(scale: str) -> str:
    """The label-skew suite's setting at ``scale``, with its local optimiser and the methods that keep
    their own (``Method.own_optimiser``)."""
    from fedskew.algorithms import registered

    own = sorted(n for n, c in registered().items() if c.own_optimiser)
    return (f"{LABEL_SKEW_NOTE[scale]}; local SGD at lr {LABEL_SKEW_LR[scale]} x {{1/3, 1, 3}} with momentum 0.9"
            + (f", except {', '.join(own)}, whose client optimiser is the method's own (its lr x {{1/3, 1, 3}}, "
               f"its momentum)" if own else ""))


def suite_names() -> list[str]:
    return sorted(SUITES)


def check_suite(name: str, scale: str) -> None:
    if name not in SUITES:
        raise ConfigError(f"bench suite '{name}' is not known{did_you_mean(name, SUITES)}; `fedskew bench --list` "
                          f"lists them: {', '.join(suite_names())}.")
    if scale not in SCALES:
        raise ConfigError(f"bench --scale '{scale}' is not allowed; use one of {', '.join(SCALES)}.")


def sweeps(name: str, scale: str, data_root: str | None = None, methods: list[str] | None = None) -> dict[str, dict]:
    """part -> the sweep spec (a mapping) of that part of the suite at ``scale``; ``methods``
    keeps only those methods. A part whose methods search a grid selects on a validation hold-out
    (``selection.split: validation``): the bench never chooses on test data."""
    from fedskew.experiments.presets import reproduction
    from fedskew.experiments.spec import grid_points, load_spec

    check_suite(name, scale)
    out = {}
    for paper in SUITES[name]["papers"]:
        if paper.startswith("niid-"):
            spec = niid_bench(paper.split("-", 1)[1], scale, data_root)
        elif paper.startswith("label-skew-"):
            spec = label_skew(paper.rsplit("-", 1)[1], scale, data_root, methods)
        else:
            spec = reproduction(paper, SCALES[scale], data_root)
        if spec is None:
            continue
        if methods is not None:
            spec["methods"] = [m for m in spec["methods"] if (m if isinstance(m, str) else m["name"]) in methods]
            if not spec["methods"]:
                continue
        parsed = load_spec(spec)
        if any(len(grid_points(m.options, m.trials)) > 1 for m in parsed.methods) and \
                parsed.selection.split != "validation":
            spec["selection"] = {**spec.get("selection", {}), "split": "validation", "metric": None}
        spec["name"] = f"bench {name} {paper} {scale}"
        out[paper] = spec
    return out


def restrict(parts: dict[str, dict], name: str, keep: list[str] | None = None, seeds: list[str] | None = None,
             execution: dict[str, str | None] | None = None, settings: list[str] | None = None) -> dict[str, dict]:
    """``parts`` (from :func:`sweeps`) cut to the parts named in ``keep``, the seeds in ``seeds``
    and the settings (the sweeps' partition labels, e.g. ``#C=2``) in ``settings``, with execution
    keys (``device``, ``executor``, ``checkpoint_every``: where and how the runs train, never the
    setting; the executors agree to float round-off) set in every part's base config. A name,
    seed or setting the suite does not have is one sentence."""
    from fedskew.config import ConfigError

    if keep is not None:
        unknown = [k for k in keep if k not in SUITES[name]["papers"]]
        if unknown:
            raise ConfigError(f"bench --parts names {unknown[0]!r}, which is not a part of suite '{name}'; its parts: "
                              f"{', '.join(SUITES[name]['papers'])}.")
        parts = {k: v for k, v in parts.items() if k in keep}
        if not parts:
            raise ConfigError(f"bench --parts {','.join(keep)}: none of these parts has a run with the methods asked "
                              f"for at this scale.")
    if settings is not None:
        known = sorted({label for spec in parts.values() for label in spec.get("partitions", {})})
        unknown = [x for x in settings if x not in known]
        if unknown:
            raise ConfigError(f"bench --settings names {unknown[0]!r}, which is not a setting of suite '{name}'"
                              f"{did_you_mean(unknown[0], known)}; its settings: {', '.join(known)}.")
        parts = {k: {**v, "partitions": {p: c for p, c in v["partitions"].items() if p in settings}}
                 for k, v in parts.items() if any(p in settings for p in v.get("partitions", {}))}
    out = {}
    for paper, spec in parts.items():
        spec = {**spec, "base": {**spec["base"], **{k: v for k, v in (execution or {}).items() if v is not None}}}
        if seeds is not None:
            wanted = []
            for v in seeds:
                if not v.lstrip("-").isdigit() or int(v) not in spec["seeds"]:
                    raise ConfigError(f"bench --seeds names {v!r}, which is not a seed of part '{paper}'; its seeds: "
                                      f"{', '.join(map(str, spec['seeds']))}.")
                wanted.append(int(v))
            spec["seeds"] = [x for x in spec["seeds"] if x in wanted]
            tune = (spec.get("selection") or {}).get("tune_seeds")
            if tune is not None:
                spec["selection"] = {**spec["selection"], "tune_seeds": [x for x in tune if x in wanted] or None}
        out[paper] = spec
    return out


def part_folder(paper: str, scale: str) -> str:
    """The folder of a suite's part inside the suite folder: the part's name, except at smoke scale,
    where a part named by its data set (``label-skew-fmnist``, ``niid-fmnist``) trains on the bundled
    digits and its folder says so (``label-skew-digits``)."""
    return paper.removesuffix("-fmnist") + "-digits" if scale == "smoke" and paper.endswith("-fmnist") else paper


def suite_dir(name: str, scale: str, out: str | Path | None = None) -> Path:
    return Path(out) if out is not None else Path("runs") / f"bench-{name}-{scale}"


MARKER = "bench.yaml"


def claim_folder(folder: Path, name: str, scale: str, write: bool = True) -> None:
    """A suite folder holds one suite at one scale (``bench.yaml`` says which): running or
    rebuilding another there is one sentence, never a replaced leaderboard; ``write``: mark an
    unmarked folder as this suite's (when its runs start)."""
    import yaml

    from fedskew.engine.durable import atomic_write_text, blocking_file

    blocked = blocking_file(Path(folder))
    if blocked is not None:
        raise ConfigError(f"bench --out '{folder}' cannot be a suite folder: '{blocked}' is a file, not a folder; "
                          f"give another --out.")
    from fedskew.files import FileProblem, read_yaml

    marker = Path(folder) / MARKER
    if os.path.lexists(marker):
        try:
            held = read_yaml(marker, "suite marker", own=True)
        except FileProblem as exc:
            raise ConfigError(f"{str(exc).removesuffix('.')}; a suite folder's marker is what fedskew bench writes, so "
                              f"nothing is written in '{folder}': give another --out.") from None
        held = held if isinstance(held, dict) else {}
        if (held.get("suite"), held.get("scale")) != (name, scale):
            raise ConfigError(f"folder '{folder}' holds bench suite '{held.get('suite')}' at scale "
                              f"'{held.get('scale')}', not '{name}' at '{scale}'; give another --out.")
        return
    if Path(folder).is_dir() and any(Path(folder).iterdir()):
        parts = {part_folder(p, scale) for p in SUITES[name]["papers"]}  # (smoke's label-skew part: -digits)
        other = [p.name for p in Path(folder).iterdir() if p.is_dir() and p.name not in parts]
        if other or not any((Path(folder) / p).is_dir() for p in parts):
            raise ConfigError(f"folder '{folder}' already holds files that are not bench suite '{name}''s "
                              f"({', '.join(sorted(p.name for p in Path(folder).iterdir())[:3])}); give another --out.")
    if not write:
        return
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        atomic_write_text(yaml.safe_dump({"suite": name, "scale": scale}), marker)
    except OSError:  # a read-only folder: the rebuild says so itself
        pass


def check_has_runs(folder: Path, name: str, scale: str) -> None:
    """One sentence when a suite folder holds no results of any of its parts (``bench --report`` writes
    no empty board, which would make the folder another suite's for every later bench)."""
    if not any((Path(folder) / part_folder(p, scale) / "results.sqlite").is_file() for p in SUITES[name]["papers"]):
        raise ConfigError(f"bench --report: '{folder}' holds no runs of suite '{name}' at scale '{scale}', so no "
                          f"leaderboard is written; `fedskew bench {name} --scale {scale} --out {folder}` runs them.")


def listing(data_root: str | None = None) -> list[dict]:
    """Every suite with its size per scale: parts, runs, the published entries its runs sit beside
    (:func:`linked_entries`) of the suite's papers' entries, and the time it takes (:func:`estimate`)."""
    import warnings

    from fedskew.config import InertOptionWarning
    from fedskew.experiments.spec import load_spec, planned_count

    entries = load()
    rows = []
    for name, suite in SUITES.items():
        for scale in SCALES:
            with warnings.catch_warnings():  # (an inert option is said when a run starts, not when it is listed)
                warnings.simplefilter("ignore", InertOptionWarning)
                parts = sweeps(name, scale, "DATA")
                runs = sum(planned_count(load_spec(spec)) for spec in parts.values())
                linked = len(linked_entries(name, scale, entries, parts))
            total = sum(1 for e in entries if any(e.file in PAPERS[p]["files"] for p in suite["papers"]))
            rows.append({"suite": name, "scale": scale, "papers": ", ".join(suite["papers"]), "runs": runs,
                         "published": f"{linked} of {total}" if total else "0", "linked": linked, "total": total,
                         "about": suite["about"], "time": estimate(name, scale, runs)})
    return rows


@functools.cache
def _timings() -> dict:
    """``bench_timings.yaml``: the run time measured for each suite and scale."""
    import yaml

    return yaml.load((Path(__file__).parent / "bench_timings.yaml").read_text(),
                     Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}


def estimate(name: str, scale: str, runs: int, out: str | Path | None = None) -> str:
    """The time a suite takes with 2 jobs: its runs x the mean run time measured in its folder
    (``runs/bench-<suite>-<scale>``, when it has finished runs), else the run time measured for the
    suite on the 2-core CPU machine this project is built on (``bench_timings.yaml``), else
    "not measured". GPU times are not measured yet."""
    import sqlite3

    folder, seconds, where = suite_dir(name, scale, out), [], ""
    for db_path in folder.glob("*/results.sqlite"):
        db = sqlite3.connect(db_path)
        try:
            seconds += [f - s for s, f in db.execute("SELECT started, finished FROM runs WHERE status='done' AND "
                                                     "started IS NOT NULL AND finished IS NOT NULL")]
        finally:
            db.close()
    if seconds:
        per_run, where = statistics.fmean(seconds), f"measured in {folder}"
    else:
        known = (_timings().get(name) or {}).get(scale)
        if not known:
            return "not measured"
        per_run, where = float(known["seconds_per_run"]), known["where"]
    total = runs * per_run / 2
    text = f"{total / 60:.0f} min" if total < 5400 else f"{total / 3600:.1f} h"
    return f"~{text} with 2 jobs ({where})"


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


def linked_entries(name: str, scale: str, entries: list[Entry] | None = None,
                   parts: dict[str, dict] | None = None) -> list[Entry]:
    """The published entries a run of the suite at ``scale`` sits beside: the entry's table is on
    the data set the scale trains (``PAPERS[part]["reference"]``), it needs no method options the
    presets do not run, and the preset runs its method label under its setting. The others (the
    papers' other data sets, models or tables) no preset runs: `fedskew bench --list` counts them.
    ``parts``: the suite's :func:`sweeps` at that scale, when the caller has them."""
    from fedskew.experiments.spec import load_spec

    entries = load() if entries is None else entries
    out = []
    for paper, spec in (sweeps(name, scale, "DATA") if parts is None else parts).items():
        dataset = PAPERS[paper]["reference"].get(scale)
        if dataset is None:
            continue
        loaded = load_spec(spec)
        planned = {(m.column, p) for m in loaded.methods for p in loaded.partitions}
        out += [e for e in entries if e.file in PAPERS[paper]["files"] and not e.options and _dataset(e) == dataset
                and (e.run_label, e.setting.label) in planned]
    return out


def unlinked_table() -> str:
    """Markdown: the registry's entries that no suite links at any scale, counted by file and why
    (docs/reproductions.md holds it between its ``generated unlinked-entries`` markers;
    tests/test_docs.py checks it)."""
    import warnings

    from fedskew.config import InertOptionWarning
    from fedskew.experiments.spec import load_spec

    entries = load()
    run_sets: dict[str, set] = {}  # data set -> the (label, setting) pairs some preset on it runs
    with warnings.catch_warnings():  # (an inert option is said when a run starts)
        warnings.simplefilter("ignore", InertOptionWarning)
        linked = {id(e) for name in SUITES for scale in SCALES for e in linked_entries(name, scale, entries)}
        for name in SUITES:
            for scale in SCALES:
                for paper, spec in sweeps(name, scale, "DATA").items():
                    dataset = PAPERS[paper]["reference"].get(scale)
                    if dataset is not None:
                        loaded = load_spec(spec)
                        run_sets.setdefault(dataset, set()).update((m.column, q) for m in loaded.methods
                                                                   for q in loaded.partitions)
    counts = Counter()
    for e in entries:
        if id(e) in linked:
            continue
        if e.options:
            why = "it needs method options the presets do not run"
        elif _dataset(e) not in run_sets:
            why = f"no preset trains on its data set ({_dataset(e)})"
        else:
            why = f"the presets on {_dataset(e)} do not run its method under its setting (another table, model or row)"
        counts[(e.file, why)] += 1
    rows = "".join(f"| {f} | {n} | {why} |\n" for (f, why), n in sorted(counts.items()))
    return (f"{len(entries) - len(linked)} of the registry's {len(entries)} entries sit beside no run of any suite "
            f"at any scale (`fedskew bench --list` prints, per suite and scale, how many it links):\n\n"
            f"| file | entries | why no preset runs them |\n|---|---|---|\n{rows}")


def leaderboard(name: str, scale: str, out: str | Path | None = None) -> list[Cell]:
    """Our finished runs of the suite at ``scale`` beside the linked published entries."""
    from fedskew.experiments.selection import results_table

    check_suite(name, scale)
    entries = load()
    folder = suite_dir(name, scale, out)
    cells = []
    for paper in sweeps(name, scale, "DATA"):
        sweep_dir = folder / part_folder(paper, scale)
        rows = results_table(sweep_dir) if (sweep_dir / "results.sqlite").exists() else []
        dataset = PAPERS[paper]["reference"].get(scale)
        if dataset is None:  # a part no published table is linked to
            continue
        for e in entries:
            if e.file not in PAPERS[paper]["files"] or e.options or _dataset(e) != dataset:
                continue
            ours = [
                r[e.metric.key]
                for r in rows
                if r.get("label") == e.run_label
                and r.get("partition") == e.setting.label
                and r.get("status") == "done"
                and r.get("selected", True)
                and r.get(e.metric.key) is not None
                and not (isinstance(r.get(e.metric.key), float) and math.isnan(r[e.metric.key]))
            ]
            cells.append(Cell(paper, e, ours))
    return cells


def _dataset(e: Entry) -> str:
    d = e.setting.config.get("dataset")
    return d["name"] if isinstance(d, dict) else d


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


# ---------------------------------------------------------------------------------------------
# The leaderboard: methods x settings, ranks, paired tests, and the published numbers beside ours

BOARD_METRICS = {"global/test_acc_mean_last10": "global accuracy (test set, mean of the last 10 rounds)",
                 "personal/final_acc_after": "personalised accuracy (each client's local test split, after one "
                                             "final local pass from the last global model)",
                 "unseen/final_acc_after": "accuracy on held-out clients never trained on (their local test "
                                           "splits, after the method's personalisation pass from the last model)"}
@dataclass
class Board:
    """One part of a suite for one metric: the selected point's value per method, setting and seed.
    A cell without a value is "none" (the method has no such model: it is not ranked there), or
    failed or not run: it ranks last in its setting, tied with the other such cells, so that a
    failure never improves a method's average rank."""

    part: str  # its title: the suite's part, or for label-skew the data it ran on
    metric: str
    labels: list[str]
    settings: list[str]
    values: dict[tuple[str, str], dict[int, float]]
    chosen: dict[tuple[str, str], dict]
    tried: dict[tuple[str, str], int]
    failed: dict[tuple[str, str], int]
    ran: set[tuple[str, str]]  # (method, setting) with finished runs of the chosen point
    seeds: int = 0  # the seeds a cell should have (the sweep's)
    chance: float | None = None  # chance accuracy (a fraction): never bold at it
    wall_s: float = 0.0  # seconds the finished runs of this part trained (their rounds' times)
    runs: int = 0  # finished runs of this part, every trial included
    rounds: int = 0  # the runs' rounds (the sweep's base)
    baseline: str = "fedavg"  # the method wins/ties/losses are counted against (the spec's report.baseline)

    def mean(self, label: str, setting: str) -> float | None:
        v = list(self.values.get((label, setting), {}).values())
        return 100 * statistics.fmean(v) if v else None

    def std(self, label: str, setting: str) -> float | None:
        v = list(self.values.get((label, setting), {}).values())
        return 100 * statistics.stdev(v) if len(v) > 1 else None

    def none(self, label: str, setting: str) -> bool:
        """The method has finished runs here but no such value (no global model): not ranked."""
        return self.mean(label, setting) is None and (label, setting) in self.ran and \
            not self.failed.get((label, setting))

    def ranks(self, setting: str) -> dict[str, float]:
        """Rank in ``setting`` of every method but the "none" ones (1 = best; ties share the mean
        rank); a failed or missing cell ranks last, tied with the others."""
        means = {m: self.mean(m, setting) for m in self.labels if not self.none(m, setting)}
        return average_ranks({m: (-math.inf if v is None else v) for m, v in means.items()})

    def average_rank(self, label: str) -> float | None:
        r = [self.ranks(s)[label] for s in self.settings if label in self.ranks(s)]
        return statistics.fmean(r) if r else None

    def versus(self, label: str, setting: str, baseline: str) -> str | None:
        """'W', 'T' or 'L' against ``baseline`` by :func:`paired_test`; None without two common seeds."""
        return paired_test(self.values.get((label, setting), {}), self.values.get((baseline, setting), {}))


def average_ranks(values: dict[str, float]) -> dict[str, float]:
    """Rank per key, 1 for the largest value; tied values share the mean of their ranks."""
    order = sorted(values, key=lambda k: -values[k])
    out, i = {}, 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in order[i:j + 1]:
            out[k] = (i + j) / 2 + 1
        i = j + 1
    return out


@dataclass
class Agreement:
    """How far two boards rank the same methods alike in one setting (:func:`rank_agreement`)."""

    tau: float  # Kendall's tau-b of the two boards' means
    p: float  # its two-sided p-value (the null: no association)
    n: int  # methods both boards rank
    moves: list[tuple[str, float, float]]  # (method, rank on the first board, rank on the second), largest first

    def sentence(self, first: str, second: str) -> str:
        moved = "; ".join(f"{m} (#{a:g} {first}, #{b:g} {second})" for m, a, b in self.moves) or "none"
        few = " (with fewer than 5 methods no ranking can reach p < 0.05)" if self.n < 5 else ""
        return (f"Kendall's tau-b {self.tau:.2f}, p = {self.p:.2g} over the {self.n} methods both rank{few}; moved "
                f"most (rank among them): {moved}")


def rank_agreement(first: dict[str, float], second: dict[str, float], movers: int = 3) -> Agreement | None:
    """Kendall's tau-b between two boards' means of the methods both have (``scipy.stats.kendalltau``:
    tied means counted as tau-b counts them; its two-sided p-value is exact for up to 33 methods
    without ties, else the normal approximation), and the ``movers`` methods whose ranks among
    those methods (1 = best, ties sharing the mean rank, :func:`average_ranks`) differ most. None
    with fewer than 3 common methods."""
    from scipy.stats import kendalltau

    common = sorted(set(first) & set(second))
    if len(common) < 3:
        return None
    a, b = [first[m] for m in common], [second[m] for m in common]
    if len(set(a)) == 1 or len(set(b)) == 1:  # one board ties them all: tau is undefined
        return None
    result = kendalltau(a, b)
    ra, rb = average_ranks(dict(zip(common, a))), average_ranks(dict(zip(common, b)))
    moves = sorted(((m, ra[m], rb[m]) for m in common if ra[m] != rb[m]), key=lambda t: (-abs(t[1] - t[2]), t[0]))
    return Agreement(float(result.statistic), float(result.pvalue), len(common), moves[:movers])


def board_agreement(first: list[str], second: str, first_name: str, second_name: str) -> list[str]:
    """Per ranked table and setting that the written boards ``first`` (``leaderboard.md`` texts,
    joined: the campaign's steps each hold some of a table's methods) and ``second`` share: one line
    of :class:`Agreement` between their means. A method's rows that a board shows beside its own
    (``NAME (board)``) are not its own and are left out; a method two of ``first`` both rank is one
    sentence (ConfigError)."""
    joined: dict[str, dict[str, dict[str, float]]] = {}  # title -> setting -> method -> mean
    for text in first:
        for title, (header, rows) in board_tables(text).items():
            settings = header[1:header.index("avg rank")]
            for j, setting in enumerate(settings, start=1):
                cells = joined.setdefault(title, {}).setdefault(setting, {})
                for method, mean in column_means(rows, j).items():
                    if method in cells:
                        raise ConfigError(f"{method} has a mean in '{title}', {setting}, on two of the boards joined "
                                          f"as {first_name}; join boards of different methods.")
                    cells[method] = mean
    lines = []
    for title, (header, rows) in board_tables(second).items():
        settings = header[1:header.index("avg rank")]
        for j, setting in enumerate(settings, start=1):
            got = rank_agreement(joined.get(title, {}).get(setting, {}), column_means(rows, j))
            if got is not None:
                lines.append(f"{title}, {setting}: {got.sentence(first_name, second_name)}.")
    return lines


def boards(name: str, scale: str, out: str | Path | None = None, methods: list[str] | None = None) -> list[Board]:
    """Per part of the suite and per metric of :data:`BOARD_METRICS` that some run recorded: the
    board of the runs the selection chose, of every method the folder's sweep.yaml names, or of
    ``methods`` (the suite's entries for them: ``bench --report --methods``)."""

    from fedskew.experiments.selection import selected_runs
    from fedskew.experiments.spec import load_spec, planned_points, read_record
    from fedskew.experiments.store import cell, open_sweep

    check_suite(name, scale)
    out_boards = []
    suite = sweeps(name, scale, "DATA", methods)
    for paper in suite:
        folder = suite_dir(name, scale, out) / part_folder(paper, scale)
        if not (folder / "results.sqlite").is_file():
            continue
        spec = read_record(folder)
        if methods and spec:
            spec = {**spec, "methods": load_spec(suite[paper]).model_dump(mode="json")["methods"]}
        db = open_sweep(folder)
        try:
            res = selected_runs(db, spec)
            planned = planned_points(load_spec(spec)) if spec else None
            points: dict[tuple[str, str], set[str]] = {}
            for r in db.execute("SELECT label, partition, params FROM runs"):
                if planned is None or (r["label"], r["params"]) in planned:  # not a trial of an earlier grid
                    points.setdefault((r["label"], r["partition"]), set()).add(r["params"])
            tried = {k: len(v) for k, v in points.items()}
            done = [cell(db, r, "summary") for r in db.execute("SELECT run_id, label, params, summary FROM runs "
                                                               "WHERE status='done'")
                    if r["label"] in res.labels and (planned is None or (r["label"], r["params"]) in planned)]
        finally:
            db.close()
        chosen = {k: json.loads(v["params"]) for k, v in res.selections.items()}
        base = (spec.get("base") or {}).get("dataset")
        dataset = base.get("name") if isinstance(base, dict) else base
        wall = sum((d.get("time/round_s_mean") or 0.0) * (d.get("rounds") or 0) for d in done)
        # a label-skew part is titled by the data it ran on
        title = f"label-skew on {dataset}" if paper.startswith("label-skew-") and dataset else paper
        for metric in BOARD_METRICS:
            values = {k: {r.seed: float(r.summary[metric]) for r in runs if _number(r.summary.get(metric))}
                      for k, runs in res.runs.items()}
            # a setting whose finished runs none recorded the metric (the unseen clients' outside the
            # setting that holds some out) is left out of the metric's board, not shown as "none"
            settings = [p for p in res.partitions if any(values.get((m, p)) for m in res.labels)
                        or not any(res.runs.get((m, p)) for m in res.labels)]
            if any(values.values()):
                out_boards.append(Board(title, metric, res.labels, settings, values, chosen, tried, res.failed,
                                        {k for k, runs in res.runs.items() if runs}, len(spec.get("seeds") or []),
                                        chance_of(dataset, metric), wall, len(done),
                                        int((spec.get("base") or {}).get("rounds") or 0),
                                        (spec.get("report") or {}).get("baseline") or "fedavg"))
    return out_boards


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _params_text(params: dict) -> str:
    return ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(params.items())) or "-"


def board_rows(board: Board, baseline: str | None) -> tuple[list[list[str]], dict[str, list[int]]]:
    """The table's rows (methods by average rank) and each method's wins/ties/losses against
    ``baseline``."""
    ranks = {s: board.ranks(s) for s in board.settings}
    bold = {s: bold_labels({m: board.values.get((m, s), {}) for m in board.labels}, board.chance)
            for s in board.settings}
    rows, record = [], {}
    for label in sorted(board.labels, key=lambda m: (board.average_rank(m) is None, board.average_rank(m) or 0, m)):
        cells, wtl = [label], [0, 0, 0]
        for s in board.settings:
            mean, std, n = board.mean(label, s), board.std(label, s), len(board.values.get((label, s), {}))
            rank = f" (#{ranks[s][label]:g})" if label in ranks[s] else ""
            if mean is None:
                failed = board.failed.get((label, s), 0)
                cells.append((f"failed ({failed})" if failed else "none" if board.none(label, s) else "not run") + rank)
                continue
            text = f"{mean:.2f}" + (f" +- {std:.2f}" if std is not None else "") + rank
            if board.seeds and n < board.seeds:
                text += f" ({n}/{board.seeds} seeds)"
            cells.append(f"**{text}**" if label in bold[s] else text)
            outcome = board.versus(label, s, baseline) if baseline and label != baseline else None
            if outcome:
                wtl["WTL".index(outcome)] += 1
        avg = board.average_rank(label)
        cells.append("-" if avg is None else f"{avg:.2f}")
        cells.append("/".join(map(str, wtl)) if baseline and label != baseline and sum(wtl) else "-")
        rows.append(cells)
        record[label] = wtl
    return rows, record


TIME_LINE = "Wall-clock time (differs from run to run, not a result):"


def board_summary(board: Board, baseline: str | None, record: dict[str, list[int]]) -> str:
    """The facts of a board in one generated paragraph (prose cites these, never restates them):
    leader and last by average rank, significant wins and losses against ``baseline``, the cells
    that failed or lack seeds, runs and the time they trained."""
    ranked = sorted((r, m) for m in board.labels if (r := board.average_rank(m)) is not None)
    if not ranked:
        return "Summary (generated): no method has a value yet."
    firsts = [m for r, m in ranked if r == ranked[0][0]]
    lasts = [m for r, m in ranked if r == ranked[-1][0]]
    wins = sorted((m, w[0]) for m, w in record.items() if w[0])
    losses = sorted((m, w[2]) for m, w in record.items() if w[2])
    shown = set(board.settings)  # (a board may leave settings out: the unseen clients' shows one)
    failed = sorted((m, s) for (m, s), n in board.failed.items() if n and s in shown and board.mean(m, s) is None)
    partial = sorted((m, s) for (m, s), v in board.values.items()
                     if v and s in shown and board.seeds and len(v) < board.seeds)
    def listing(pairs):
        return (", ".join(f"{m} ({n})" for m, n in pairs) or "none")
    text = (f"Summary (generated): {len(board.labels)} methods, {len(board.settings)} "
            f"setting{'s' if len(board.settings) != 1 else ''}. ")
    if len(firsts) == len(ranked):  # every ranked method ties: one sentence, not a first and a last
        text += f"All {len(ranked)} ranked methods tie by average rank ({ranked[0][0]:.2f})."
    else:
        text += (f"First by average rank: {', '.join(firsts)} ({ranked[0][0]:.2f}); last: {', '.join(lasts)} "
                 f"({ranked[-1][0]:.2f}).")
    if baseline:
        text += (f" Significant wins against {baseline}, {len(wins)} method{'s' if len(wins) != 1 else ''} "
                 f"(settings): {listing(wins)}; significant losses, {len(losses)} method"
                 f"{'s' if len(losses) != 1 else ''}: {listing(losses)}.")
    text += (f" Cells whose every run failed: {len(failed)}" + (f" ({', '.join(f'{m} {s}' for m, s in failed)})"
                                                                 if failed else "") +
             f"; cells missing seeds: {len(partial)}" +
             (f" ({', '.join(f'{m} {s}' for m, s in partial)})" if partial else "") + ".")
    if board.runs:
        took = f"{board.wall_s / 3600:.1f} h" if board.wall_s >= 3600 else f"{board.wall_s / 60:.1f} min"
        # on a line of its own, marked: the one line of a board that differs between an interrupted
        # and resumed bench and an uninterrupted one, so a comparison can skip it
        text += f"\n\n{TIME_LINE} the {board.runs:,} finished runs of {board.part} trained for {took} in all."
    return text


def board_sections(board: Board) -> list:
    """A board as report sections: the methods x settings table with its generated summary, then
    the budget and choices."""
    from fedskew.experiments.report import Section

    base = board.baseline if board.baseline in board.labels else None
    rows, record = board_rows(board, base)
    what = BOARD_METRICS[board.metric]
    if board.rounds and board.rounds < 10:  # (the mean of the last 10 is of every round when there are fewer)
        what = what.replace("mean of the last 10 rounds", f"mean of its {board.rounds} rounds")
    one_seed = board.seeds == 1
    table = Section(f"{board.part}: {what}",
                    f"`{board.metric}`, percent: " + ("one seed (no spread, nothing bold, no paired test)"
                                                      if one_seed else "mean +- std over seeds")
                    + " of the configuration the selection chose, (#k) its rank in the setting (1 = best; a cell "
                    "whose every run failed, or that has not run, ranks last, tied with the others), average rank "
                    "over the settings it is ranked in, and "
                    f"wins/ties/losses against {base or '-'} by a two-sided paired t-test over seeds "
                    f"(p < {SIGNIFICANCE}). {'' if one_seed else BOLD_RULE} 'none': the method has no such model "
                    "(not ranked); 'failed (n)': n runs failed; 'not run': no finished run yet; (k/n seeds): the "
                    "mean of the k seeds that finished, ranked by it.\n\n" + board_summary(board, base, record),
                    ["method", *board.settings, "avg rank", f"W/T/L vs {base or '-'}"], rows)
    if board.metric != next(iter(BOARD_METRICS)):
        return [table]
    many = max(board.tried.values(), default=1) > 1
    budget = Section(f"{board.part}: budget and the configuration each method's selection chose",
                     "Trials: configurations tried per setting on the tuning seed (the same budget for every "
                     "method). " + ("Chosen: by the mean validation accuracy of the last 10 rounds (a method with no "
                                    "global model: by its clients' personal models on the validation hold-out, "
                                    f"`{PERSONAL_VALIDATION}`), never by test data; ties within float round-off go "
                                    "to the earlier trial (the defaults first)." if many else
                                    "One trial each: the defaults, nothing chosen."),
                     ["method", "trials", *board.settings],
                     [[m, "/".join(sorted({str(board.tried.get((m, s), 0)) for s in board.settings})),
                       *(_params_text(board.chosen[(m, s)]) if (m, s) in board.chosen else "-"
                         for s in board.settings)] for m in board.labels])
    return [table, budget]


def published_sections(cells: list[Cell]) -> list:
    """One section per (registry table, setting): ours beside the published values."""
    from fedskew.experiments.report import Section

    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.paper, c.entry.file, c.entry.setting_id), []).append(c)
    out = []
    for (paper, _file, setting), group in groups.items():
        e0 = group[0].entry
        text = f"{e0.source.paper}, {e0.source.venue}. Metric: {e0.metric.meaning}." + \
            (f" Published spread: {e0.spread_meaning}." if e0.spread_meaning else "")
        if e0.setting.differs:
            text += " Setting keys that differ from the paper: " + "; ".join(
                f"`{k}`: {v}" for k, v in e0.setting.differs.items()) + "."
        rows = []
        for c in sorted(group, key=lambda c: -(c.mean if c.mean is not None else -1)):
            ours = "not run" if c.mean is None else f"{c.mean:.2f}" + (f" +- {c.std:.2f}" if c.std is not None else "")
            pub = f"{c.entry.value:.2f}" + (f" ({c.entry.spread:.2f})" if c.entry.spread is not None else "")
            within = "-" if c.within is None else ("yes" if c.within else "no")
            rows.append([c.entry.method, ours, str(len(c.ours)), pub, _fmt(c.delta), within, c.entry.cite])
        out.append(Section(f"{paper}: {e0.source.table}, {setting} ({e0.metric.key})", text,
                           ["method", "ours", "seeds", "published", "delta", "within", "source"], rows))
    return out


def measured_where(name: str, scale: str, folder: Path, methods: list[str] | None = None) -> str:
    """Where the suite's finished runs (of ``methods`` only, when given) ran, from their recorded
    environments: fedskew commit, torch, CPU or GPU and torch threads, with the number of runs of each."""
    seen = Counter((r.get("env/git_commit", "no git commit"), r.get("env/torch", "?"),
                    r.get("env/device_name") or r.get("env/cpu") or r.get("env/device", "?"),
                    r.get("env/torch_threads", "?")) for r in done_rows(name, folder, methods))
    return "; ".join(f"fedskew {commit}, torch {torch}, {device}, {threads} torch thread(s) ({n:,} finished "
                     f"run{'s' if n != 1 else ''} of the suite)" for (commit, torch, device, threads), n in
                     seen.most_common())


def done_rows(name: str, folder: Path, methods: list[str] | None = None):
    """The suite's finished runs in ``folder`` (of ``methods`` only, when given), as results rows."""
    from fedskew.experiments.selection import results_table

    for _, part in part_dirs(name, folder):
        yield from (r for r in results_table(part)
                    if r.get("status") == "done" and (not methods or r.get("method") in methods))


def part_dirs(name: str, folder: Path):
    """(part, its folder) of each part of suite ``name`` that has a results database in ``folder``."""
    for paper in SUITES[name]["papers"]:
        for sub in dict.fromkeys((paper, part_folder(paper, "smoke"))):
            if (folder / sub / "results.sqlite").is_file():
                yield paper, folder / sub


def code_of_runs(name: str, folder: Path, methods: list[str] | None = None) -> Counter:
    """The code the suite's finished runs (of ``methods`` only, when given) ran: fedskew's commit as
    each run recorded it (``+dirty``: a working tree with uncommitted changes), or its version where
    fedskew was not a git checkout, with the number of runs of each."""
    return Counter(r.get("env/git_commit") or f"version {r.get('env/fedskew', '?')}"
                   for r in done_rows(name, folder, methods))


def inert_options(name: str, folder: Path, methods: list[str] | None = None) -> dict[str, str]:
    """Method label -> what its options switch off (``Method.inert``) in every finished run of the
    suite in ``folder``, for the labels where each run says so (CFL's ``start_round`` at lite scale:
    its every run is FedAvg's); a board says it beside the cells."""
    import warnings

    from pydantic import ValidationError

    from fedskew.algorithms import method_inert
    from fedskew.config import InertOptionWarning, MethodConfig
    from fedskew.experiments.store import cell, connect

    said: dict[str, set] = {}
    for _, part in part_dirs(name, folder):
        db = connect(part / "results.sqlite", read_only=True)
        try:
            rows = db.execute("SELECT run_id, label, method, config FROM runs WHERE status='done'").fetchall()
            configs = [(row["label"], row["method"], cell(db, row, "config")) for row in rows]
        finally:
            db.close()
        seen: dict[str, str | None] = {}
        for label, method, c in configs:
            if methods and method not in methods:
                continue
            try:
                key = json.dumps([c["method"], c["rounds"], c["partition"].get("num_clients"),
                                  c["clients_per_round"]], sort_keys=True)
                if key not in seen:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", InertOptionWarning)
                        seen[key] = method_inert(MethodConfig.model_validate(c["method"]), int(c["rounds"]),
                                                 int(c["partition"].get("num_clients", 0)), c["clients_per_round"])
            except (KeyError, TypeError, AttributeError, ValueError, ValidationError, ConfigError):
                continue  # an edited config: no note of inert options (the board's cells stand on their own)
            said.setdefault(label, set()).add(seen[key])
    return {label: next(iter(texts)) for label, texts in sorted(said.items()) if None not in texts and len(texts) == 1}


def mixed_code(code: Counter) -> str | None:
    """One sentence when the runs do not come from one clean commit, else None."""
    dirty = sum(n for c, n in code.items() if c.endswith("+dirty"))
    if len(code) <= 1 and not dirty:
        return None
    listed = ", ".join(f"{c} ({n:,} runs)" for c, n in code.most_common())
    return (f"its runs come from {len(code)} code version{'s' if len(code) > 1 else ''} ({listed})"
            + (f", {dirty:,} of them from a working tree with uncommitted changes" if dirty else ""))


def written_sections(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Each section of a written board (split before every ``## ``): its title, its lines and the cells of its
    table's rows, header first (the ``|---|`` rule left out; none: no table). The one reader of a board's
    markdown: the bench's rank checks here, the docs' figures (docs/_ext) and the evidence pages
    (benchmarks/evidence_pages.py) all go through it."""
    out = []
    for section in re.split(r"\n(?=## )", text):
        lines = section.splitlines() or [""]
        rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines
                if ln.startswith("| ") and not ln.startswith("|---")]
        out.append((lines[0].lstrip("# ").strip(), lines, rows))
    return out


def board_tables(text: str) -> dict[str, tuple[list[str], list[list[str]]]]:
    """The ranked tables of a written board (``leaderboard.md``): section title -> (header, rows)."""
    out = {}
    for title, _, cells in written_sections(text):
        if len(cells) >= 3 and "avg rank" in cells[0]:  # (a board ranks two methods at least) a row of another
            rows = [row for row in cells[1:] if len(row) == len(cells[0]) and row[0]]  # width is not the table's
            if rows:
                out[title] = (cells[0], rows)
    return out


def _cell_mean(cell: str) -> float | None:
    m = re.match(r"\**(-?\d+\.\d+)", cell)
    return float(m.group(1)) if m else None


def column_means(rows: list[list[str]], j: int) -> dict[str, float]:
    """Method -> mean of column ``j`` of a written board's ranked table, for the rows that have one
    and are the board's own (not a ``NAME (board)`` row that :func:`beside` put there)."""
    out = {}
    for row in rows:
        mean = _cell_mean(row[j])
        if mean is not None and not row[0].endswith(" (board)"):
            out[row[0]] = mean
    return out


def beside(sections: list, board_text: str, where: str) -> list[str]:
    """Put the rows of a committed board (``board_text``, a ``leaderboard.md``) beside a board's own
    rows: in each ranked table whose title the committed board shares, its methods that this board
    did not run join as ``NAME (board)`` rows with their cells in the settings this board shows, and
    every row is ranked again by mean (the average rank over those settings). Bold and the paired
    tests stay this board's own runs': the committed rows come without them. Returns one sentence a
    table: whether this board's baseline equals the committed board's in every shared cell."""
    committed = board_tables(board_text)
    said = []
    for sec in sections:
        if not sec.header or "avg rank" not in sec.header or sec.title not in committed:
            continue
        theirs_header, theirs = committed[sec.title]
        settings = sec.header[1:sec.header.index("avg rank")]
        col = {s: theirs_header.index(s) for s in settings if s in theirs_header}
        if not col:
            continue
        ours = {row[0]: row for row in sec.rows}
        baseline = sec.header[-1].removeprefix("W/T/L vs ").strip()
        for row in theirs:
            if row[0] in ours:
                continue
            sec.rows.append([f"{row[0]} (board)", *(re.sub(r"\*\*", "", row[col[s]]) if s in col else "not run"
                                                    for s in settings), "-", "-"])
        for j in range(1, len(settings) + 1):  # ranks again, over every row
            means = {i: _cell_mean(r[j]) for i, r in enumerate(sec.rows) if not r[j].startswith("none")}
            ranks = average_ranks({i: (-math.inf if v is None else v) for i, v in means.items()})
            for i, r in enumerate(sec.rows):
                bare = re.sub(r" \(#[\d.]+\)", "", r[j])
                if i in ranks:
                    bare = bare[:-2] + f" (#{ranks[i]:g})**" if bare.endswith("**") else bare + f" (#{ranks[i]:g})"
                r[j] = bare
        for r in sec.rows:
            got = [float(m.group(1)) for c in r[1:1 + len(settings)] if (m := re.search(r"\(#([\d.]+)\)", c))]
            r[len(settings) + 1] = f"{statistics.fmean(got):.2f}" if got else "-"
        sec.rows.sort(key=lambda r: (r[len(settings) + 1] == "-", float(r[len(settings) + 1])
                                     if r[len(settings) + 1] != "-" else 0.0, r[0]))
        mine = ours.get(baseline)
        theirs_base = next((row for row in theirs if row[0] == baseline), None)
        if mine and theirs_base:
            pairs = [(_cell_mean(mine[1 + settings.index(s)]), _cell_mean(theirs_base[c])) for s, c in col.items()]
            diffs = [abs(a - b) for a, b in pairs if a is not None and b is not None]
            text = (f"{baseline} equals {where}'s to the last digit in all {len(diffs)} shared cells" if diffs and
                    max(diffs) == 0 else f"{baseline} differs from {where}'s by up to {max(diffs):.2f} points in "
                                          f"{len(diffs)} shared cells (another torch, CPU or thread count moves the "
                                          f"last digits)" if diffs else f"{baseline} shares no cell with {where}")
            said.append(f"{sec.title}: {text}.")
        ranked = []
        for j, s in enumerate(settings, start=1):
            got = rank_agreement(column_means(list(ours.values()), j), column_means(theirs, col[s]) if s in col else {})
            if got is not None:
                ranked.append(f"{s}: {got.sentence('here', 'there')}")
        said += [f"{sec.title}, {line}." for line in ranked]
        sec.text += (f"\n\nBeside it: the rows marked (board) are {where}'s, in the settings this board ran, "
                     f"ranked again with this board's rows by mean; their cells are not bold and their paired "
                     f"tests are not shown (the committed board keeps no seeds' values)."
                     + (" How far the two boards rank the methods both ran alike: " + "; ".join(ranked) + "."
                        if ranked else ""))
    return said


def write_leaderboard(name: str, scale: str, command: str, out: str | Path | None = None,
                      methods: list[str] | None = None, title: str | None = None,
                      strict: bool = False, beside_board: Path | None = None
                      ) -> tuple[Path, Path, list[Cell], list[str]]:
    """``leaderboard.md`` and ``leaderboard.html`` in the suite folder from the runs it has (of
    ``methods`` only, when given; ``title`` for a study in the suite's setting that is not the suite,
    benchmarks/momentum_control.py); returns both paths and the published cells (for the console).
    A board whose runs come from more than one commit, or from a tree with uncommitted changes,
    says so first; ``strict`` refuses to write it (one sentence). ``beside_board``: a committed
    board's ``leaderboard.md`` whose rows join this board's (:func:`beside`); the last value returned
    says whether the baseline reproduces that board's."""
    from fedskew.experiments.report import Section, to_html, to_markdown

    folder = suite_dir(name, scale, out)
    folder.mkdir(parents=True, exist_ok=True)
    mixed = mixed_code(code_of_runs(name, folder, methods))
    if mixed and strict:
        raise ConfigError(f"bench --strict: the board of '{folder}' is not built: {mixed}; rebuild its runs at one "
                          f"commit of a clean tree (or leave --strict out).")
    cells = leaderboard(name, scale, folder)
    intro = Section("How to read it",
                    f"Scale: {SCALE_NOTE[scale] if cells else label_skew_note(scale)}. Rebuild: `{command}` "
                    + ("(add `--report` to rebuild the tables only)" if command.startswith("fedskew bench") else
                       f"(`fedskew bench {name} --scale {scale} --out {folder} --report` rebuilds the tables only)")
                    + ". Ours: mean +- std over the seeds that finished "
                    "(percent) of the configuration chosen on a validation hold-out (never on test data) where a "
                    "method had more than one."
                    + (" Published: the paper's value (its spread, see each table); delta = ours - published; "
                       "'within' = |delta| <= the published spread." if cells else ""))
    where = measured_where(name, scale, folder, methods)
    if where:
        intro.text += f" Measured with {where}; CPU results are exact to the last digit only with the same torch, " \
                      f"CPU and thread count."
    inert = inert_options(name, folder, methods)
    if inert:
        intro.text += " Options that act in none of a method's runs here (`Method.inert`, generated): " + "; ".join(
            f"{label}: {text}" for label, text in inert.items()) + "."
    sections = ([Section("Not from one clean commit", f"This board is not from one clean commit: {mixed}. "
                                                      f"`--report --strict` refuses such a board.")]
                if mixed else []) + [intro]
    for board in boards(name, scale, folder, methods):
        sections += board_sections(board)
    said = []
    if beside_board is not None:
        from fedskew.files import read_text

        board_text = read_text(beside_board, "bench --beside board")
        if not board_tables(board_text):
            raise ConfigError(f"bench --beside '{beside_board}' holds no ranked table of a board; give a board's "
                              f"leaderboard.md, such as docs/leaderboards/label-skew-lite.md.")
        said = beside(sections, board_text, str(beside_board))
    sections += published_sections(cells)
    title = title or f"fedskew bench {name} ({scale})"
    md, page = folder / "leaderboard.md", folder / "leaderboard.html"
    from fedskew.engine.durable import atomic_write_text
    from fedskew.engine.rundir import STORAGE_ERRNOS, StorageError

    try:  # whole files or none: a full disk never leaves a leaderboard cut short
        atomic_write_text(to_markdown(title, sections, folder), md)
        atomic_write_text(to_html(title, sections), page)
    except OSError as exc:
        if exc.errno not in STORAGE_ERRNOS:
            raise
        raise StorageError(f"the leaderboard cannot be written in '{folder}' ({exc.strerror or exc}); free space or "
                           f"give a writable --out, then `--report` rebuilds it from the runs.") from None
    return md, page, cells, said


__all__ = [
    "Agreement",
    "Board",
    "Cell",
    "claim_folder",
    "PAPERS",
    "SCALES",
    "SUITES",
    "average_ranks",
    "board_agreement",
    "boards",
    "estimate",
    "leaderboard",
    "listing",
    "paired_test",
    "rank_agreement",
    "suite_dir",
    "suite_method",
    "sweeps",
    "trials",
    "write_leaderboard",
]
