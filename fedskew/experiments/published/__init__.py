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


def load(folder: Path = HERE) -> list[Entry]:
    """Every entry of every registry file, validated (a bad file is one sentence naming it)."""
    from fedskew.config import ConfigError

    out = []
    for path in sorted(folder.glob("*.yaml")):
        try:
            spec = PublishedFile.model_validate(yaml.safe_load(path.read_text()))
        except Exception as exc:
            raise ConfigError(f"published-results file '{path.name}' is not valid ({str(exc).splitlines()[0][:200]}).") \
                from None
        for e in spec.entries:
            if e.setting not in spec.settings:
                raise ConfigError(f"published-results file '{path.name}': entry {e.row} / {e.column} names setting "
                                  f"'{e.setting}', which the file does not define.")
            out.append(Entry(path.name, spec.source, spec.metric, spec.spread, e.setting, spec.settings[e.setting],
                             e.row, e.column, e.method, e.options, e.value, e.spread, e.label, e.config))
    return out


__all__ = ["Entry", "load"]
