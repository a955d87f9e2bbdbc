"""A sweep file's schema (:class:`SweepSpec`: methods x grids x partitions x seeds, the selection,
the resources per run), the plan of runs it makes and each run's identity; the sweep file's format
is in :mod:`fedskew.experiments.sweep`. Nothing here runs or stores anything.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, conint, field_validator, model_validator

from fedskew.algorithms.base import StrictOptions
from fedskew.config import (
    ADDED_RUN_KEYS,
    MAX_SEED,
    ConfigError,
    did_you_mean,
    former_architecture_keys,
    load_yaml,
    nested,
    set_key,
    validate_config,
    without_added,
)

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
    split: Literal["validation", "test"] | None = Field(
        None, description="validation: a stratified hold-out of the training data (validation_fraction) in every "
        "run chooses; test: the test set chooses, as some papers' protocols did (named so in the report); default: "
        "validation when a method has more than one point to choose from, else no hold-out (nothing is chosen)")
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


class ReportSpec(_Strict):
    """Options of ``fedskew report`` a sweep file may set."""

    metric: str | None = Field(None, description="the metric of the main table (default: the selection's)")
    baseline: str | None = Field(None, description="the method others are compared with (default fedavg)")


class SweepSpec(_Strict):
    name: str = "sweep"
    base: dict[str, Any] = Field(default_factory=dict)
    methods: list[MethodSpec]
    partitions: dict[str, dict[str, Any]] = Field(default_factory=lambda: {"default": {}})
    seeds: list[conint(ge=0, le=MAX_SEED)] = Field(default_factory=lambda: [0])
    selection: SelectionSpec = Field(default_factory=SelectionSpec)
    report: ReportSpec = Field(default_factory=ReportSpec, description="options of fedskew report (metric, "
                                                                        "baseline)")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="per run, on Ray (--ray)")

    @field_validator("methods", mode="before")
    @classmethod
    def _names(cls, v):
        if not isinstance(v, (list, type(None))):
            return v  # (pydantic says what a list was expected to be)
        return [{"name": m} if isinstance(m, str) else m for m in (v or [])]

    @model_validator(mode="after")
    def _default_split(self):
        """No ``selection.split``: a validation hold-out when the sweep chooses among points, else none
        (a sweep with one point per method chooses nothing, and a hold-out would only take data away)."""
        if self.selection.split is None:
            chooses = any(len(grid_points(m.options, m.trials)) > 1 for m in self.methods)
            self.selection.split = "validation" if chooses else "test"
            if chooses and self.selection.metric and not self.selection.metric.startswith("global/val_"):
                raise ValueError(f"selection.metric '{self.selection.metric}' reads test data; a sweep that chooses "
                                 f"among points selects on a validation hold-out (a global/val_* metric), or says "
                                 f"selection.split: test")
        return self

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


def read_record(sweep_dir: str | Path) -> dict:
    """A sweep folder's ``sweep.yaml`` (the spec as run), read through the file boundary and validated
    as a sweep: {} where there is none; one sentence naming the file and the key where it is not a
    sweep (a crafted or damaged record)."""
    from fedskew.files import FileProblem, read_yaml

    path = Path(sweep_dir) / "sweep.yaml"
    if not os.path.lexists(path):
        return {}
    data = read_yaml(path, "sweep record", own=True)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise FileProblem(f"sweep record '{path}' must hold a mapping of keys, not a {type(data).__name__}.")
    try:
        return load_spec(data).model_dump(mode="json")
    except ConfigError as exc:
        raise FileProblem(f"sweep record '{path}' is not a sweep as fedskew writes it: {exc}") from None


def load_spec(data: dict | str | Path) -> SweepSpec:
    """A sweep spec from a mapping or a YAML file, with one-sentence errors."""
    if not isinstance(data, dict):
        from fedskew.files import read_text

        path = Path(data)
        data = load_yaml(read_text(path, "sweep file"), f"sweep file '{path}'") or {}
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
RUN_SETTINGS = ("lr", "local_epochs", "batch_size", "momentum", "weight_decay", "lr_decay", "grad_clip", "optimizer",
                "adam_betas", "adam_eps", "lr_schedule", "lr_decay_every", "lr_min")

# Config keys added after sweep run ids were first hashed, each with the value that means "as before
# the key existed": a run at that value keeps the id it had, so a new option (a new method's model
# switch) never orphans the finished runs of a sweep. tests/test_sweep.py pins an id: a key added to
# the schema without an entry here fails it.
ADDED_KEYS = {"model.conditional_policy": False, "model.dropout": 0.0, **ADDED_RUN_KEYS}


# Keys whose default changed after sweep run ids were first hashed: (the new default, the value the ids
# were hashed with). A run at the new default keeps the id it had (``executor``: the executors agree to
# float round-off, so a finished run is the same run on either).
CHANGED_DEFAULTS = {"executor": ("auto", "sequential")}


def run_identity(cfg: dict) -> dict:
    """The part of a resolved run config that names the run: all of it but :data:`NOT_IDENTITY`,
    the :data:`ADDED_KEYS` that are at their as-before value, and :data:`CHANGED_DEFAULTS` at the
    value their ids were hashed with."""
    out = {k: v for k, v in cfg.items() if k not in NOT_IDENTITY}
    for key, (new, old) in CHANGED_DEFAULTS.items():
        if out.get(key) == new:
            out[key] = old
    if isinstance(out.get("model"), dict) and isinstance(out.get("method"), dict):  # keys that left the schema
        out["model"] = {**former_architecture_keys(out["method"]), **out["model"]}
    return without_added(out, ADDED_KEYS)


def tune_seeds(spec: SweepSpec) -> list[int]:
    """The seeds the grid runs on (every seed unless ``selection.tune_seeds``)."""
    return spec.seeds if spec.selection.tune_seeds is None else spec.selection.tune_seeds


def plan(spec: SweepSpec, chosen: dict[tuple[str, str], dict] | None = None) -> list[dict]:
    """Every run of the sweep: id, label, method, grid point, partition, seed, config. With
    ``selection.tune_seeds``: the grid on those seeds, then, for each (label, partition) in
    ``chosen`` (:func:`select`'s answer), its point on the other seeds."""
    from fedskew.algorithms import method_code

    runs = []
    for method in spec.methods:
        for params in grid_points(method.options, method.trials):
            for partition in spec.partitions:
                seeds = list(tune_seeds(spec))
                if spec.selection.tune_seeds is not None and (chosen or {}).get((method.column, partition),
                                                                               {}).get("params") == params:
                    tuned = set(seeds)
                    seeds += [s for s in spec.seeds if s not in tuned]
                for seed in seeds:
                    cfg = run_config(spec, method, params, partition, seed)
                    code = method_code(method.name)  # a user's method: its module's source
                    key = json.dumps([method.column, params, partition, seed, run_identity(cfg)] +
                                     ([code] if code else []), sort_keys=True)
                    runs.append({"run_id": hashlib.sha1(key.encode()).hexdigest()[:12], "label": method.column,
                                 "method": method.name, "params": params, "partition": partition, "seed": seed,
                                 "config": cfg})
    return runs


def planned_points(spec: SweepSpec) -> set[tuple[str, str]]:
    """(method label, grid point as stored in the results database) of every point the sweep's
    grid has now: what selection and a trial count may read."""
    return {(m.column, json.dumps(p, sort_keys=True)) for m in spec.methods for p in grid_points(m.options, m.trials)}


def grid_size(options: dict[str, Any], trials: list[dict[str, Any]] | None = None) -> int:
    """How many points :func:`grid_points` gives, counted without making them."""
    if trials is not None:
        return len(trials)
    return math.prod(len(v) for v in options.values() if isinstance(v, list))


MAX_RUNS = 10_000  # a sweep larger than this is refused unless the user says --yes: a typo in a grid is not a week


def planned_count(spec: SweepSpec) -> int:
    """How many runs the sweep makes: :func:`plan`'s, plus (with ``selection.tune_seeds``) the
    selected point of every group on the other seeds."""
    tuned = set(tune_seeds(spec))
    extra = len([s for s in spec.seeds if s not in tuned]) * len(spec.methods) * len(spec.partitions)
    # the length of plan(spec), counted without building any run's config or grid point
    points = sum(grid_size(m.options, m.trials) for m in spec.methods)
    return points * len(spec.partitions) * len(tune_seeds(spec)) + (extra if spec.selection.tune_seeds is not None
                                                                     else 0)


def rounds_per_run(spec: SweepSpec) -> float:
    """The mean number of rounds of the sweep's runs (what its progress counts in)."""
    runs = plan(spec)
    return sum(int(r["config"].get("rounds", 0) or 0) for r in runs) / max(1, len(runs))


def default_sweep_dir(spec: SweepSpec) -> Path:
    """``runs/sweep-<name>``, the name made safe for a folder."""
    slug = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in spec.name.split(":")[0]).strip("-")
    return Path("runs") / f"sweep-{slug}"


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))


__all__ = ["ADDED_KEYS", "MethodSpec", "ReportSpec", "ResourcesSpec", "SelectionSpec", "SweepSpec", "default_jobs",
           "default_sweep_dir", "grid_points", "load_spec", "plan", "planned_count", "planned_points", "read_record",
           "rounds_per_run", "run_config", "run_identity", "tune_seeds"]
