"""Every table a page quotes from a sweep is rebuilt from the committed per-run results
(fedskew.experiments.evidence): the page may say nothing else."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fedskew.config import ConfigError
from fedskew.experiments.evidence import BLOCK, front_table, read_runs, refresh

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from front_page import pages  # noqa: E402


def test_every_generated_block_is_what_its_runs_give():
    found = pages(ROOT)
    assert {p.relative_to(ROOT).as_posix() for p in found} >= {"README.md", "docs/tutorials/first-sweep.md",
                                                                  "docs/tutorials/own-method.md"}
    for page in found:
        text = page.read_text()
        assert refresh(text, ROOT) == text, (f"{page.relative_to(ROOT)}: a generated block differs from its runs; "
                                             f"run benchmarks/front_page.py")
        for m in BLOCK.finditer(text):
            assert m.group("body").strip(), f"{page}: an empty generated block"


def rows(values: dict[str, list[float]], metric="global/test_acc_mean_last10"):
    return [{"label": label, "partition": "P", "seed": s, "status": "done", "selected": True, "dataset": "digits",
             metric: v} for label, vs in values.items() for s, v in enumerate(vs)]


def test_the_table_is_mean_and_sample_std_in_percent_with_the_top_group_bold():
    # a: mean 0.80, sample std 0.01; b: mean 0.70 (worse in every paired seed: p < 0.05); c: ties a
    table = front_table(rows({"a": [0.79, 0.80, 0.81], "b": [0.69, 0.70, 0.71], "c": [0.70, 0.82, 0.85]}),
                        [("global/test_acc_mean_last10", "g")], {"a": "A"})
    body = table.splitlines()[2]
    assert body == "| g | **80.00 +- 1.00** | 70.00 +- 1.00 | **79.00 +- 7.94** |"
    assert table.splitlines()[0] == "| P on digits (%) | A | b | c |"


def test_a_run_that_was_not_selected_or_did_not_finish_is_left_out():
    r = rows({"a": [0.5, 0.6, 0.7]})
    r += [{**r[0], "seed": 9, "selected": False, "global/test_acc_mean_last10": 0.0},
          {**r[0], "seed": 8, "status": "failed", "global/test_acc_mean_last10": 0.0}]
    assert "| **60.00 +- 10.00** |" in front_table(r, [("global/test_acc_mean_last10", "g")])


@pytest.mark.parametrize("line, said", [("{", "is not valid JSON"), ("[1, 2]", "is not a run of fedskew's export"),
                                        ('{"label": "a"}', "is not a run of fedskew's export")])
def test_a_damaged_export_is_one_sentence(tmp_path, line, said):
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(rows({"a": [0.5]})[0]) + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=said) as info:
        read_runs(path)
    assert "line 2" in str(info.value) and "\n" not in str(info.value)
