"""The published-results registry: numbers from the papers' tables, each with its paper, table, row
and column, the setting as a fedskew config and the metric it is comparable to.

One YAML file per table (or per part of one), transcribed by hand: ``source`` (paper, venue,
table), ``metric`` (a ``summary.json`` key and what the paper measured), ``spread`` (what the
numbers in parentheses are, if any), ``selection`` (how the paper chose hyper-parameters),
``settings`` (id -> ``config``, a fedskew config of the setting, and ``differs``: the keys that do
not express the paper's setting exactly, and why) and ``entries`` (setting, row, column, method with
its options, value, spread). :func:`load` validates every file; ``tests/test_bench.py`` checks that
every entry's config validates.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field

from fedskew.algorithms.base import StrictOptions

HERE = Path(__file__).parent


_Strict = StrictOptions  # unknown keys are errors (one strict base for every schema)


class Source(_Strict):
    paper: str = Field(min_length=3)
    venue: str = Field(min_length=3)
    table: str = Field(min_length=3)


class Metric(_Strict):
    key: str
    meaning: str = Field(min_length=3)


class Setting(_Strict):
    label: str
    config: dict[str, Any]
    differs: dict[str, str] = Field(default_factory=dict, description="config key -> why it differs from the paper")


class EntrySpec(_Strict):
    setting: str
    row: str
    column: str
    method: str
    options: dict[str, Any] = Field(default_factory=dict)
    label: str | None = Field(None, description="the sweep label it is compared with (default: the method)")
    config: dict[str, Any] = Field(default_factory=dict, description="run config keys of this row only "
                                                                     "(e.g. model.classifier: etf)")
    value: float
    spread: float | None = None


class PublishedFile(_Strict):
    source: Source
    metric: Metric
    spread: str | None = None
    seeds: int | None = None
    selection: str | None = None
    omitted: str | None = None
    settings: dict[str, Setting]
    entries: list[EntrySpec]


@dataclass(frozen=True)
class Entry:
    """One published number, with everything needed to place it beside ours."""

    file: str
    source: Source
    metric: Metric
    spread_meaning: str | None
    setting_id: str
    setting: Setting
    row: str
    column: str
    method: str
    options: dict
    value: float
    spread: float | None
    label: str | None = None
    row_config: dict | None = None

    @property
    def run_label(self) -> str:
        """The label of the sweep runs this entry is compared with."""
        return self.label or self.method

    @property
    def cite(self) -> str:
        return f"{self.source.table}, row {self.row}, column {self.column}"

    def config(self) -> dict:
        """The setting with this entry's method: a config ``fedskew.load_config`` validates."""
        from fedskew.config import nested

        data = nested(self.setting.config)
        for key, value in nested(self.row_config or {}).items():
            data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else \
                ({"name": data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), str) else value)
        return {**data, "method": {"name": self.method, **self.options}}


class _UniqueKeys(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # (libyaml's parser where installed)
    """YAML's safe loader that refuses a key given twice in one mapping (plain YAML keeps the last
    and drops the first without a word: a registry note was once lost that way)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' (its keys may be overridden)
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.YAMLError(f"key '{key}' is given twice in one mapping (lines {seen[key] + 1} and "
                                     f"{key_node.start_mark.line + 1})")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load(folder: Path = HERE) -> list[Entry]:
    """Every entry of every registry file, validated (a bad file is one sentence naming it)."""
    import math

    from pydantic import ValidationError

    from fedskew.algorithms import did_you_mean, registered
    from fedskew.config import ConfigError

    out, seen = [], {}
    for path in sorted(folder.glob("*.yaml")):
        try:
            spec = PublishedFile.model_validate(yaml.load(path.read_text(), Loader=_UniqueKeys))
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise ConfigError(f"published-results file '{path.name}': key '{where}' is not valid ({err['msg']}).") \
                from None
        except Exception as exc:
            raise ConfigError(
                f"published-results file '{path.name}' is not valid ({str(exc).splitlines()[0][:200]})."
            ) from None
        for i, e in enumerate(spec.entries):
            where = f"published-results file '{path.name}': entries.{i} ({e.row} / {e.column})"
            if e.setting not in spec.settings:
                raise ConfigError(f"{where} names setting '{e.setting}', which the file does not define.")
            if not math.isfinite(e.value) or (e.spread is not None and not math.isfinite(e.spread)):
                raise ConfigError(f"{where} has value {e.value} and spread {e.spread}; both must be finite numbers.")
            if e.method not in registered():
                raise ConfigError(f"{where} names method '{e.method}', which is not registered"
                                  f"{did_you_mean(e.method, registered())}.")
            key = (e.setting, e.row, e.column, e.label)
            if key in seen.setdefault(path.name, set()):
                raise ConfigError(f"{where} appears twice in the file (setting {e.setting}); keep one.")
            seen[path.name].add(key)
            out.append(Entry(path.name, spec.source, spec.metric, spec.spread, e.setting, spec.settings[e.setting],
                             e.row, e.column, e.method, e.options, e.value, e.spread, e.label, e.config))
    return out


__all__ = ["Entry", "load"]
