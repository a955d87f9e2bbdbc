"""Every table a page quotes from a sweep is rebuilt from the committed per-run results
(fedskew.experiments.evidence): the page may say nothing else."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


# -- committed boards recompute from their shipped runs -------------------------------------------------

from ship_board import MANIFEST, manifest_of, unpack  # noqa: E402


def shipped_boards() -> list[tuple[Path, Path]]:
    """(folder of a board's runs, the board's page): docs/leaderboards/NAME/ beside NAME.md, and a
    GPU-campaign step's folder with its leaderboard.md inside."""
    out = [(d, d.parent / f"{d.name}.md") for d in sorted((ROOT / "docs" / "leaderboards").iterdir())
           if (d / "bench.yaml").is_file()]
    out += [(d, d / "leaderboard.md") for d in sorted((ROOT / "docs" / "gpu-campaign").iterdir())
            if (d / "bench.yaml").is_file()]
    return out


def test_the_committed_boards_ship_their_runs():
    shipped = {page.name for _, page in shipped_boards()}
    assert {"niid-bench-lite.md", "leaderboard.md"} <= shipped


@pytest.mark.parametrize("folder, page", shipped_boards(), ids=lambda p: p.name if p.name != "leaderboard.md" else
                         p.parent.name)
def test_every_cell_of_a_committed_board_recomputes_from_its_runs(tmp_path, folder, page):
    import yaml

    from fedskew.experiments.bench import write_leaderboard

    committed = page.read_text()
    meta = yaml.safe_load((folder / "bench.yaml").read_text())
    shipped = yaml.safe_load((folder / MANIFEST).read_text()) if (folder / MANIFEST).is_file() else {}
    named = manifest_of(committed)
    suite = unpack(folder, tmp_path / "suite")
    for stale in ("leaderboard.md", "leaderboard.html", MANIFEST):
        (suite / stale).unlink(missing_ok=True)
    default_title = f"fedskew bench {meta['suite']} ({meta['scale']})"
    md, _, _, _ = write_leaderboard(meta["suite"], meta["scale"], named["command"], suite,
                                    title=None if named["title"] == default_title else named["title"])
    rebuilt = md.read_text()
    if shipped.get("folder"):
        rebuilt = rebuilt.replace(str(suite), shipped["folder"])
    assert rebuilt == committed, f"{page.relative_to(ROOT)} is not what its runs give: rebuild it from {folder.name}"


# -- the evidence pages are what their generator writes from the committed results ---------------------

import evidence_pages  # noqa: E402


@pytest.mark.parametrize("name", sorted(evidence_pages.PAGES))
def test_an_evidence_page_is_what_its_generator_writes(name):
    committed = (ROOT / "docs" / name).read_text()
    assert committed == evidence_pages.PAGES[name](), f"docs/{name} differs: run python benchmarks/evidence_pages.py"


def test_the_reproductions_page_gives_each_published_cell_its_verdict():
    """Every row of the page is a row of a committed board's published table, with the verdict its
    delta and the 'within' column give; the counts of the summary add up."""
    boards = [evidence_pages.read_board(p) for p in evidence_pages.board_pages()]
    rows = {(r["source"], r["method"], r["ours"]): r for b in boards for t in b["tables"] for r in t["rows"]}
    page = (ROOT / "docs" / "reproductions.md").read_text()
    seen = 0
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[1].startswith("`"):
            row = rows[(cells[0], cells[1].strip("`"), cells[3])]
            assert cells[2] == row["published"] and cells[5] == row["delta"]
            delta = float(row["delta"])
            expected = ("within the published spread" if row["within"] == "yes" else
                        ("above" if delta > 0 else "below") + (", outside the spread" if row["within"] == "no" else ""))
            assert cells[6] == expected
            seen += 1
    assert seen > 0
    summed = sum(int(m) for m in re.findall(r"\| (\d+) \(\d+ within", page))
    assert summed == seen


def test_the_map_preset_is_what_the_changelog_and_the_tutorial_say():
    """An outside check found 'all 21 methods of MAP's comparison' false: the preset runs 19 of the
    methods the registry holds for MAP's tables, plus FedBABU and FedLC, and not FedDF."""
    from fedskew.experiments.bench import sweeps
    from fedskew.experiments.published import load

    registry = {e.method for e in load() if e.file.startswith("map_")}
    preset = {m if isinstance(m, str) else m.get("label") or m["name"]
              for m in sweeps("seed-papers", "lite", "DATA")["map"]["methods"]}
    assert (len(preset), len(preset & registry), preset - registry, registry - preset) == \
        (21, 19, {"fedbabu", "fedlc"}, {"feddf"})
    for page in ("CHANGELOG.md", "docs/tutorials/reproduce-a-row.md"):
        text = " ".join((ROOT / page).read_text().split())
        assert "runs 21 methods in the setting of MAP's" in text and "19 of" in text and "all 21" not in text


def test_fuzz_an_exported_runs_file(tmp_path):
    """The reader of a committed export (docs/evidence/*.jsonl) goes through the file boundary: any
    bytes, any JSON line, are the runs or one sentence naming the file, never a traceback."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    line = st.one_of(st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
                     st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=10),
                                  lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                      max_size=5),
                                  max_leaves=20).map(json.dumps))

    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(lines=st.lists(line, max_size=4))
    def check(lines):
        path = tmp_path / "runs.jsonl"
        path.write_text("\n".join(lines), encoding="utf-8", errors="surrogateescape")
        try:
            rows = read_runs(path)
        except ConfigError as exc:
            assert "runs.jsonl" in str(exc) and "\n" not in str(exc)
            return
        assert all(isinstance(r, dict) and {"label", "partition", "seed", "status"} <= set(r) for r in rows)

    check()


# -- the frameworks comparison: what it writes for the peers -----------------------------------------

import peers  # noqa: E402


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sets(st.integers(0, 4), min_size=1, max_size=3), min_size=1, max_size=8),
       st.lists(st.integers(0, 4), max_size=60))
def test_the_test_set_is_dealt_out_once_to_the_holders_of_each_class(classes, labels):
    y = np.array(labels, dtype=np.int64)
    held = set().union(*classes)
    if not set(labels) <= held:
        with pytest.raises(SystemExit, match="held by no client"):
            peers.deal_test([np.array(sorted(c)) for c in classes], y)
        return
    shares = peers.deal_test([np.array(sorted(c)) for c in classes], y)
    assert sorted(np.concatenate(shares).tolist()) == list(range(len(y)))  # every image exactly once
    for share, cs in zip(shares, classes):
        assert set(y[share].tolist()) <= cs  # only the classes a client holds
    for c in set(labels):  # a class's images split as evenly as they go among its holders
        sizes = [int((y[share] == c).sum()) for share, cs in zip(shares, classes) if c in cs]
        assert max(sizes) - min(sizes) <= 1


def test_the_peers_command_names_no_path_of_the_machine_that_ran_it():
    cmd = ("python benchmarks/peers.py --data DATA_DIR --pfllib /home/me/PFLlib --flbench /home/me/FL-bench "
           "--out /home/me/runs --json benchmarks/results/peers-cpu.json")
    assert peers.public_command(cmd) == ("python benchmarks/peers.py --data DATA_DIR --pfllib PFLLIB_CLONE --flbench "
                                         "FLBENCH_CLONE --json benchmarks/results/peers-cpu.json")


def test_the_peers_benchmark_never_writes_over_a_partition_it_did_not_write(tmp_path):
    for write, folder, theirs in ((lambda root: peers.write_flbench(root, [], tmp_path), "data/fmnist", "args.json"),
                                  (lambda root: peers.write_pfllib(root, [], None, None, None, None),
                                   f"dataset/{peers.PFL_NAME}", "0.npz")):
        root = tmp_path / folder.split("/")[0] / "clone"
        (root / folder).mkdir(parents=True)
        (root / folder / theirs).write_text("the user's")
        with pytest.raises(SystemExit, match="did not write"):
            write(root)
        assert (root / folder / theirs).read_text() == "the user's" and not (root / folder / peers.MARKER).exists()
