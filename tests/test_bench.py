"""Issue 31 (first part): the published-results registry, ``fedskew bench`` end to end at smoke
scale, and the rule that a validation-split selection never reads test scores."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedskew.config import ConfigError, validate_config
from fedskew.experiments.published import load
from fedskew.experiments.sweep import load_spec, run_sweep, select

SUMMARY_KEYS = {"global/test_acc", "global/test_acc_best", "global/test_acc_mean_last10", "global/test_acc_mean_last50",
                "personal/acc_after",
                "personal/acc_before", "personal/final_acc_after", "personal/final_acc_before"}


def test_every_registry_entry_validates_and_names_its_source():
    entries = load()
    assert len(entries) >= 100
    for e in entries:
        cfg = validate_config(e.config())  # the setting, with the entry's method and options, is a valid run
        assert cfg.method.name == e.method
        assert e.metric.key in SUMMARY_KEYS, e.metric.key
        assert e.source.paper and e.source.venue and e.source.table and e.row and e.column
        assert 0 <= e.value <= 100 and (e.spread is None or e.spread >= 0)
    # spot checks against the papers (read by hand): FedMR Table 1 FMNIST P10C2 FedMR, MAP Table I MAP
    fedmr = next(e for e in entries if e.file == "fedmr.yaml" and e.row == "FMNIST P10C2" and e.column == "FedMR")
    assert fedmr.value == 74.97 and fedmr.setting.config["partition"] == {"name": "pcdd", "num_clients": 10,
                                                                          "classes_per_client": 2}
    table1 = next(e for e in entries if e.file == "map_table1.yaml" and e.row == "MAP (Ours)")
    assert (table1.value, table1.spread, table1.metric.key) == (88.1, 0.54, "global/test_acc")
    assert any(e.method == "feddf" and e.options == {"public_source": "test_images"} for e in entries)
    # the neural-collapse paper's Table 1 (mean of the last 50 rounds) and a Table 2 row with the ETF head
    etf = next(e for e in entries if e.file == "etf_table1.yaml" and e.row == "FedAvg_ETF" and e.column == "C10-100-2")
    assert (etf.value, etf.method, etf.metric.key) == (79.8, "etf_gmv", "global/test_acc_mean_last50")
    scaffold_etf = next(e for e in entries if e.row == "SCAFFOLD +ETF" and e.setting_id == "C10-100-5")
    assert scaffold_etf.value == 86.1 and scaffold_etf.run_label == "scaffold-etf"
    assert validate_config(scaffold_etf.config()).model.classifier == "etf"
    fedka = next(e for e in entries if e.file == "fedka_table1.yaml" and e.row == "FedKA" and e.column == "Cifar10")
    assert fedka.value == 61.9 and fedka.setting.config["partition"]["alpha"] == 0.1


def test_a_broken_registry_file_is_one_sentence(tmp_path):
    (tmp_path / "bad.yaml").write_text("source: {paper: x}\n")
    with pytest.raises(ConfigError, match="published-results file 'bad.yaml': key 'source.paper' is not valid"):
        load(tmp_path)


def test_a_key_given_twice_in_a_registry_file_is_one_sentence_naming_file_and_lines(tmp_path):
    """YAML keeps the last of two equal keys and drops the first without a word (issue 54: a
    registry note lost that way); the registry loader refuses it, anchors' merge keys still work."""
    import shutil

    from fedskew.experiments.published import HERE

    good = (HERE / "fedka_table1.yaml").read_text()
    assert "<<: *fedka" in good  # the merge keys of a real file load
    shutil.copy(HERE / "fedka_table1.yaml", tmp_path / "fedka_table1.yaml")
    assert len(load(tmp_path)) > 10
    lines = good.splitlines()
    at = next(i for i, row in enumerate(lines) if row.strip() == "differs:")
    lines.insert(at, lines[at] + " {model: a note YAML would drop}")
    (tmp_path / "fedka_table1.yaml").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as info:
        load(tmp_path)
    assert f"'fedka_table1.yaml' is not valid (key 'differs' is given twice in one mapping (lines {at + 1} and " \
        f"{at + 2}))" in str(info.value)


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_bench_list_and_smoke_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, "-m", "fedskew.cli", "bench", "--list"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "seed-papers" in out.stdout and "smoke" in out.stdout and "paper" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "fedskew.cli", "bench", "seed-papers", "--scale", "smoke", "--jobs", "2"],
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=tmp_path,  # generous: a busy 2-core machine
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    board = (tmp_path / "runs" / "bench-seed-papers-smoke" / "leaderboard.md").read_text()
    assert "Scale: smoke: bundled digits" in board
    # a published column beside ours, with the delta, for a method the smoke run trained
    line = next(row for row in board.splitlines() if row.startswith("| fedmr |") and "Table 1, row FMNIST P" in row)
    cells = [c.strip() for c in line.strip("|").split("|")]
    ours, published, delta = float(cells[1].split()[0]), float(cells[3].split()[0]), float(cells[4])
    assert published == 74.97 or published == 75.51  # FMNIST P10C2 / P5C2, Table 1
    assert delta == pytest.approx(ours - published, abs=0.011)
    assert "Table 1, row FMNIST P" in line
    assert "| fedproc | not run | 0 | 66.28 |" in board  # a published entry the suite did not run stays listed
    assert "ours beside the published numbers" in out.stdout


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_unknown_suite_and_scale_are_one_sentence(tmp_path):
    for args, text in ((["bench", "seed-paper"], "bench suite 'seed-paper' is not known (did you mean 'seed-papers'?)"),
                       (["bench", "seed-papers", "--scale", "huge"], "bench --scale 'huge' is not allowed"),
                       (["bench", "seed-papers", "--scale", "lite"], "give the folder with --data DIR")):
        out = subprocess.run([sys.executable, "-m", "fedskew.cli", *args], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
        assert out.returncode == 2 and text in out.stderr and "Traceback" not in out.stderr


TINY = {"name": "sel", "base": {"rounds": 2, "local_epochs": 1, "partition": {"num_clients": 6},
                                "clients_per_round": 3, "model": {"name": "mlp", "hidden": [16]}},
        "methods": [{"name": "fedprox", "options": {"mu": [0.1, 0.001]}}],
        "partitions": {"P6C3": {"name": "pcdd", "classes_per_client": 3}}, "seeds": [0]}


def test_selection_by_validation_ignores_the_test_scores(tmp_path):
    """A search space whose best test score and best validation score are different points: a
    validation selection takes the validation best, a test selection the test best."""
    spec = load_spec({**TINY, "selection": {"split": "validation", "validation_fraction": 0.2}})
    db = run_sweep(spec, tmp_path, jobs=1)
    rows = db.execute("SELECT run_id, params, summary FROM runs").fetchall()
    assert len(rows) == 2
    for run_id, params, summary in rows:  # mu 0.1: best on test; mu 0.001: best on validation
        s = json.loads(summary)
        best_on_test = json.loads(params)["mu"] == 0.1
        s.update({"global/test_acc_mean_last10": 0.9 if best_on_test else 0.5,
                  "global/val_acc_mean_last10": 0.4 if best_on_test else 0.6})
        db.execute("UPDATE runs SET summary=? WHERE run_id=?", (json.dumps(s), run_id))
    db.commit()
    assert select(db, spec)[("fedprox", "P6C3")]["params"] == {"mu": 0.001}
    assert select(db, load_spec({**TINY, "selection": {"split": "test"}}))[("fedprox", "P6C3")]["params"] == {"mu": 0.1}
    with pytest.raises(ConfigError, match="selection.metric 'global/test_acc_mean_last10' reads test data"):
        load_spec({**TINY, "selection": {"split": "validation", "metric": "global/test_acc_mean_last10"}})


def test_normalize_false_gives_torchvision_to_tensor_pixels(idx_folder):
    """NIID-Bench's pipeline is ToTensor alone: pixels / 255. dataset.normalize=false gives exactly
    that (to float rounding), the default the usual mean/std normalisation; digits refuses the key."""

    import numpy as np

    from fedskew.config import load_config
    from fedskew.data.datasets import read_idx
    from fedskew.data.sources import load_dataset

    raw = load_dataset(load_config(None, ["dataset=fmnist", f"dataset.root={idx_folder}",
                                          "dataset.normalize=false"]).dataset, 0)
    normed = load_dataset(load_config(None, ["dataset=fmnist", f"dataset.root={idx_folder}"]).dataset, 0)
    pixels = read_idx(next(idx_folder.glob("train-images*"))).astype(np.float32) / 255.0
    assert np.allclose(raw.x_train[:, 0].numpy(), pixels, atol=1e-6)
    assert np.allclose(normed.x_train[:, 0].numpy(), (pixels - 0.2860) / 0.3530, atol=1e-5)
    with pytest.raises(ConfigError, match="dataset.normalize does not apply to dataset 'digits'"):
        load_config(None, ["dataset.normalize=false"])


def test_niid_bench_suite_plans_the_niid_bench_protocol_and_links_the_registry():
    from fedskew.experiments import bench
    from fedskew.experiments.sweep import plan

    sizes = {scale: sum(len(plan(load_spec(s))) for s in bench.sweeps("niid-bench", scale, "DATA").values())
             for scale in bench.SCALES}
    assert sizes == {"smoke": 20, "lite": 60, "paper": 120}  # CIFAR-10 only at paper scale
    paper = load_spec(bench.sweeps("niid-bench", "paper", "DATA")["niid-fmnist"])
    run = plan(paper)[0]["config"]
    assert (run["model"]["name"], run["rounds"], run["local_epochs"], run["batch_size"], run["lr"]) == \
        ("simplecnn", 50, 10, 64, 0.01)
    assert run["dataset"]["normalize"] is False and run["partition"]["num_clients"] == 10
    labels = {e.setting.label for e in load() if e.file == "niid_bench_flower.yaml"}
    assert labels == set(bench.NIID_PARTITIONS)


def test_trials_give_every_method_the_same_budget():
    """Every method gets exactly the budget (those without a global model too: they are chosen by
    their personal models on the hold-out): its defaults at the base lr first, then distinct points
    of its search space x the learning rates; the draw is fixed per method."""
    from fedskew.algorithms import registered
    from fedskew.algorithms.base import search_space
    from fedskew.experiments.bench import LR_FACTORS, trials

    for name, cls in registered().items():
        points = trials(name, 3, 0.01)
        assert points == trials(name, 3, 0.01)
        space, defaults = search_space(cls.Options), cls.Options().model_dump()
        assert points[0] == {**{k: defaults[k] for k in space}, "lr": 0.01}
        assert len(points) == 3 and len({json.dumps(p, sort_keys=True) for p in points}) == 3, name
        for p in points:
            assert p["lr"] in [round(0.01 * f, 8) for f in LR_FACTORS]
            assert all(p[k] in space[k] for k in space) and set(p) == {*space, "lr"}
        validate_config({"method": {"name": name, **{k: v for k, v in points[1].items() if k != "lr"}}})
    fedavg = trials("fedavg", 3, 0.03)
    assert fedavg[0] == {"lr": 0.03} and sorted(p["lr"] for p in fedavg) == [0.01, 0.03, 0.09]


def test_a_method_whose_optimiser_is_its_own_keeps_it_in_the_label_skew_suite():
    """FedCM's family trains with its own client momentum (lr 0.1, no SGD momentum): the suite tries
    it around its own lr and keeps momentum 0 in every run; every other method runs under the
    suite's common optimiser (its momentum 0.9 and base lr), FedExP's and pFedHN's run defaults
    notwithstanding."""
    from fedskew.algorithms import registered
    from fedskew.experiments import bench
    from fedskew.experiments.spec import run_config

    spec = bench.label_skew("fmnist", "lite", "DATA")
    own = sorted(m["name"] for m in spec["methods"] if "config" in m)
    assert own == sorted(n for n, c in registered().items() if c.own_optimiser) == \
        ["fedcm", "fedhbm", "ghbm", "localghbm"]
    # one optimiser for the four (benchmarks/momentum_control.py runs FedAvg under it as their control)
    assert len({json.dumps(registered()[m].run_defaults, sort_keys=True) for m in own}) == 1
    parsed = load_spec(spec)
    for m in parsed.methods:
        if m.name not in ("fedcm", "fedhbm", "fedexp", "fedavg", "pfedhn"):
            continue
        configs = [run_config(parsed, m, p, "Dir0.5", 0) for p in m.trials]
        if m.name in ("fedcm", "fedhbm"):
            assert configs[0]["lr"] == 0.1 and {c["momentum"] for c in configs} == {0.0}
            assert sorted(c["lr"] for c in configs) == sorted(p["lr"] for p in bench.trials(m.name, 3, 0.1))
            assert configs[0]["weight_decay"] == 1e-4  # the rest of its run defaults, as in any run
        else:
            assert configs[0]["lr"] == 0.01 and {c["momentum"] for c in configs} == {0.9}, m.name


def test_the_momentum_control_runs_fedavg_under_the_four_s_optimiser():
    """benchmarks/momentum_control.py: the suite's lite spec for FedAvg and the four, plus FedAvg
    whose every run has their optimiser (lr grid, momentum, weight decay) and is the baseline."""
    import importlib.util

    from fedskew.experiments.spec import run_config

    path = Path(__file__).parent.parent / "benchmarks" / "momentum_control.py"
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("momentum_control", path))
    module.__spec__.loader.exec_module(module)
    parsed = load_spec(module.spec("DATA"))
    assert [m.label or m.name for m in parsed.methods] == ["fedavg", "fedcm", "fedhbm", "ghbm", "localghbm",
                                                            "fedavg-sgd"]
    assert parsed.report.baseline == "fedavg-sgd"
    def optimiser(label):
        return sorted((c["lr"], c["momentum"], c["weight_decay"]) for m in parsed.methods
                                         if (m.label or m.name) == label
                                         for c in (run_config(parsed, m, p, "#C=2", 0) for p in m.trials))
    assert optimiser("fedavg-sgd") == sorted((lr, 0.0, 1e-4) for lr in (0.03333333, 0.1, 0.3))
    assert {o[1:] for o in optimiser("ghbm")} == {(0.0, 1e-4)} and {o[0] for o in optimiser("ghbm")} <= {
        0.03333333,
        0.1,
        0.3,
    }
    assert optimiser("fedavg") == sorted((lr, 0.9, 1e-5) for lr in (0.00333333, 0.01, 0.03))  # the library default


def test_a_resumed_sweep_counts_its_finished_runs_on_every_seed_before_it_trains(tmp_path):
    """A resumed tune-seeds sweep announces at once the finished runs it would otherwise meet only
    after the methods before them (the chosen points' other seeds), so its progress and ETA count
    them: a resumed lite bench said 411 of 2,590 runs done, and an ETA of 6 h, with 915 done."""
    import shutil
    import sqlite3

    from fedskew.experiments.sweep import SweepProgress, planned_count, rounds_per_run

    spec = load_spec({**TINY, "methods": [{"name": "fedavg", "trials": [{"lr": 0.05}, {"lr": 0.01}]},
                                          {"name": "fedprox", "trials": [{"mu": 0.01, "lr": 0.05}]}],
                      "seeds": [0, 1], "selection": {"split": "validation", "validation_fraction": 0.2,
                                                     "tune_seeds": [0]}})
    run_sweep(spec, tmp_path, jobs=1).close()
    db = sqlite3.connect(tmp_path / "results.sqlite")
    # a trial of the first method is lost: its grid is open again, the second method's is not
    (gone,) = db.execute("SELECT run_id FROM runs WHERE label='fedavg' AND seed=0 AND params LIKE '%0.01%'").fetchone()
    db.execute("UPDATE runs SET status='pending' WHERE run_id=?", (gone,))
    db.commit()
    db.close()
    shutil.rmtree(tmp_path / "runs" / gone)
    events, progress = [], SweepProgress(planned_count(spec), rounds_per_run(spec))
    run_sweep(spec, tmp_path, jobs=1, on_event=lambda kind, r: (events.append((kind, r["run_id"])),
                                                                   progress.update(kind, r))).close()
    first = next(i for i, (kind, _) in enumerate(events) if kind == "started")
    assert events[first] == ("started", gone)
    # before it: every finished run but FedAvg's on seed 1 (its choice waits for the lost trial)
    assert [kind for kind, _ in events[:first]] == ["skipped"] * 3
    assert [kind for kind, _ in events[first:] if kind != "round"] == ["started", "done", "skipped"]
    assert progress.snapshot()["runs_done"] == planned_count(spec) == 5


def test_tune_seeds_grid_on_the_tuning_seed_then_the_choice_on_the_others(tmp_path):
    """With selection.tune_seeds the grid runs on seed 0 only, the chosen point then on seed 1; the
    selection reads the tuning seed only (a terrible seed-1 score does not move it)."""
    from fedskew.experiments.sweep import planned_count

    spec = load_spec({**TINY, "methods": [{"name": "fedprox", "trials": [{"mu": 0.01, "lr": 0.05},
                                                                          {"mu": 0.1, "lr": 0.01}]}],
                      "seeds": [0, 1], "selection": {"split": "validation", "validation_fraction": 0.2,
                                                     "tune_seeds": [0]}})
    db = run_sweep(spec, tmp_path, jobs=1)
    rows = [dict(r) for r in db.execute("SELECT run_id, params, seed, config, summary FROM runs")]
    assert len(rows) == planned_count(spec) == 3
    chosen = select(db, spec)[("fedprox", "P6C3")]["params"]
    assert sorted(json.loads(r["params"]) == chosen for r in rows if r["seed"] == 0) == [False, True]
    (seed1,) = [r for r in rows if r["seed"] == 1]
    assert json.loads(seed1["params"]) == chosen
    config = json.loads(seed1["config"])
    assert config["lr"] == chosen["lr"] and config["method"] == {"name": "fedprox", "mu": chosen["mu"]}
    s = json.loads(seed1["summary"])
    s["global/val_acc_mean_last10"] = -100.0
    db.execute("UPDATE runs SET summary=? WHERE run_id=?", (json.dumps(s), seed1["run_id"]))
    db.commit()
    assert select(db, spec)[("fedprox", "P6C3")]["params"] == chosen
    with pytest.raises(ConfigError, match="gives both trials and a grid"):
        load_spec({**TINY, "methods": [{"name": "fedprox", "options": {"mu": [0.1, 1.0]}, "trials": [{"lr": 0.1}]}]})


def test_ranks_and_the_paired_test_against_hand_computed_values():
    from fedskew.experiments.bench import average_ranks, paired_test

    assert average_ranks({"a": 0.9, "b": 0.8, "c": 0.8, "d": 0.7}) == {"a": 1, "b": 2.5, "c": 2.5, "d": 4}
    base = {0: 0.5, 1: 0.6, 2: 0.7}
    # differences 1, 2, 3 points: t = 2 / (1 / sqrt 3) = 3.464 on 2 degrees of freedom, two-sided
    # p = 1 - t / sqrt(t^2 + 2) = 0.0742: not significant, a tie
    assert paired_test({s: v + d for (s, v), d in zip(base.items(), (0.01, 0.02, 0.03))}, base) == "T"
    # differences 1, 1.1, 0.9 points: t = 17.32, p = 1 - t / sqrt(t^2 + 2) = 0.0033: a win, or a loss
    better = {s: v + d for (s, v), d in zip(base.items(), (0.01, 0.011, 0.009))}
    assert paired_test(better, base) == "W" and paired_test(base, better) == "L"
    assert paired_test({0: 0.9}, {0: 0.1}) is None  # one common seed: no test
    assert paired_test({0: 0.9, 1: 0.8}, {1: 0.1, 2: 0.2}) is None


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_label_skew_smoke_end_to_end(tmp_path):
    """The label-skew suite at smoke scale with three methods: the methods x settings tables (global
    and personalised), the budget table, the HTML page, and a measured time estimate in --list."""
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "COLUMNS": "250"}
    out = subprocess.run([sys.executable, "-m", "fedskew.cli", "bench", "label-skew", "--scale", "smoke", "--methods",
                          "fedavg,fedprox,fedrep", "--jobs", "2"], capture_output=True, text=True, timeout=900,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    folder = tmp_path / "runs" / "bench-label-skew-smoke"
    board = (folder / "leaderboard.md").read_text()
    assert (
        "| method | #C=1 | #C=2 | Dir0.1 | Dir0.5 | P10C2 | C-10-2 | Dir0.5-U20 | avg rank | W/T/L vs fedavg |" in board
    )
    assert "global accuracy (test set" in board and "personalised accuracy" in board
    glob = board[board.index("global accuracy (test set"):board.index("## label-skew on digits: budget")]
    rows = {line.split("|")[1].strip(): line for line in glob.splitlines() if line.startswith("| fed")}
    assert rows["fedrep"].count("none") == 7  # FedRep has no global model
    assert rows["fedavg"].count("(#") == 7 and rows["fedavg"].endswith("| - |")  # ranks; one seed: no test
    # the clients never trained on: a board of the one setting that holds some out, every method scored
    unseen = board[board.index("accuracy on held-out clients"):]
    assert "| method | Dir0.5-U20 | avg rank | W/T/L vs fedavg |" in unseen
    assert all(
        unseen.count(f"| {m} | ") == 1 and f"| {m} | none" not in unseen for m in ("fedavg", "fedprox", "fedrep")
    )
    budget = board[board.index("budget and the configuration"):board.index("## label-skew on digits: personalised")]
    trials_of = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in budget.splitlines()
                 if line.startswith("| fed")}
    assert trials_of == {"fedavg": "2", "fedprox": "2", "fedrep": "2"}  # the same budget, FedRep too
    assert "<table>" in (folder / "leaderboard.html").read_text()
    # a board of some of the folder's methods (bench --report --methods): their rows, and the summary
    # counts their runs only (the whole folder's count was the bug)
    import sqlite3

    from fedskew.experiments.bench import estimate, write_leaderboard

    db = sqlite3.connect(folder / "label-skew-digits" / "results.sqlite")
    done = dict(db.execute("SELECT method, count(*) FROM runs WHERE status='done' GROUP BY method").fetchall())
    db.close()
    assert f"{sum(done.values())} finished runs" in board
    md, *_ = write_leaderboard("label-skew", "smoke", "cmd", folder, ["fedrep", "fedavg"])
    part = md.read_text()
    glob = part[part.index("global accuracy (test set"):part.index("## label-skew on digits: budget")]
    assert {line.split("|")[1].strip() for line in glob.splitlines() if line.startswith("| fed")} == {
        "fedavg",
        "fedrep",
    }
    assert "Summary (generated): 2 methods" in part and f"{done['fedavg'] + done['fedrep']} finished runs" in part
    assert "fedprox" not in part

    measured = estimate("label-skew", "smoke", 30, folder)  # from the runs' own start and finish times
    assert measured.startswith("~") and f"measured in {folder}" in measured
    # no runs in the folder: the committed measurement (bench_timings.yaml), 60 runs x its seconds / 2 jobs
    import yaml

    from fedskew.experiments import bench

    table = yaml.safe_load(Path(bench.__file__).with_name("bench_timings.yaml").read_text())["niid-bench"]["lite"]
    minutes = 60 * table["seconds_per_run"] / 2 / 60
    assert (
        estimate("niid-bench", "lite", 60, tmp_path / "nothing") == f"~{minutes:.0f} min with 2 jobs ({table['where']})"
    )
    assert estimate("label-skew", "paper", 60, tmp_path / "nothing") == "not measured"
    bad = subprocess.run([sys.executable, "-m", "fedskew.cli", "bench", "label-skew", "--methods", "fedavgg"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert bad.returncode == 2 and "bench --methods names 'fedavgg'" in bad.stderr and "Traceback" not in bad.stderr


def test_a_sweep_killed_before_its_selection_still_reports_its_finished_runs(tmp_path):
    """A sweep records its selection when its runs end; one killed before that (the device tool's
    time limit, a SIGKILL) has finished runs and no selection. The leaderboard's rows
    (results_table's ``selected``) and the report (selected_runs) then take the selection its
    finished runs give now: the validation best, not every grid point and not none."""
    from fedskew.experiments.selection import results_table, selected_runs
    from fedskew.experiments.store import open_sweep

    spec = load_spec({**TINY, "selection": {"split": "validation", "validation_fraction": 0.2}})
    db = run_sweep(spec, tmp_path, jobs=1)
    for run_id, params, summary in db.execute("SELECT run_id, params, summary FROM runs").fetchall():
        s = json.loads(summary)
        s["global/val_acc_mean_last10"] = 0.6 if json.loads(params)["mu"] == 0.001 else 0.4
        db.execute("UPDATE runs SET summary=? WHERE run_id=?", (json.dumps(s), run_id))
    db.execute("DELETE FROM selections")
    db.commit()
    db.close()
    rows = results_table(tmp_path)
    assert sorted((r["option/mu"], r["selected"]) for r in rows) == [(0.001, True), (0.1, False)]
    db = open_sweep(tmp_path)
    import yaml

    res = selected_runs(db, yaml.safe_load((tmp_path / "sweep.yaml").read_text()))
    assert [r.params for r in res.runs[("fedprox", "P6C3")]] == [{"mu": 0.001}]
    assert db.execute("SELECT COUNT(*) FROM selections").fetchone()[0] == 0  # a report writes nothing
    db.close()


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_bench_parts_seeds_and_executor(tmp_path):
    """``--parts``, ``--seeds`` cut a suite; ``--executor``/``--device``/``--checkpoint-every`` set
    where and how runs train (not the setting, so the published cells still match); names the
    suite lacks are one sentence."""
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    base = [sys.executable, "-m", "fedskew.cli", "bench", "seed-papers", "--scale", "smoke"]
    out = subprocess.run(base + ["--parts", "map", "--seeds", "0", "--methods", "fedavg,fedrs", "--executor",
                                 "vectorized", "--device", "cpu", "--checkpoint-every", "2", "--out", "b"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "b").iterdir() if p.is_dir()) == ["map"]
    from fedskew.experiments.selection import results_table

    rows = results_table(tmp_path / "b" / "map")
    assert sorted((r["label"], r["seed"], r["status"]) for r in rows) == [("fedavg", 0, "done"), ("fedrs", 0, "done")]
    import yaml

    for r in rows:
        cfg = yaml.safe_load((__import__("pathlib").Path(r["run_dir"]) / "config.yaml").read_text())
        assert (cfg["executor"], cfg["checkpoint_every"]) == ("vectorized", 2)
    board = (tmp_path / "b" / "leaderboard.md").read_text()
    assert "--parts map --seeds 0" in board
    fedavg = next(row for row in board.splitlines() if row.startswith("| fedavg |") and "Table I, row FedAvg" in row)
    assert "not run" not in fedavg
    for args, text in (
        (["--parts", "mapp"], "bench --parts names 'mapp', which is not a part of suite 'seed-papers'"),
        (["--parts", "map", "--seeds", "7"], "bench --seeds names '7', which is not a seed of part 'map'"),
    ):
        out = subprocess.run(base + args + ["--out", "c"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                             env=env)
        assert out.returncode == 2 and text in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_changed_grid_leaves_its_old_trials_out_of_the_selection(tmp_path):
    """A method whose search space changed between two runs of a sweep (FedAMP's did, 2026-11-26):
    the first grid's runs stay in the database, but the selection reads the current grid only (as
    the leaderboard's trial count does, through the same ``planned_points``), so every method keeps
    the same budget."""
    from fedskew.experiments.sweep import planned_points

    first = {**TINY, "methods": [{"name": "fedprox", "trials": [{"mu": 0.01, "lr": 0.05}, {"mu": 0.1, "lr": 0.05}]}],
             "selection": {"split": "validation", "validation_fraction": 0.2, "tune_seeds": [0]}}
    db = run_sweep(load_spec(first), tmp_path, jobs=1)
    old = {json.dumps(json.loads(r["params"]), sort_keys=True): r["run_id"] for r in db.execute("SELECT * FROM runs")}
    db.close()
    second = {**first, "methods": [{"name": "fedprox", "trials": [{"mu": 0.01, "lr": 0.05}, {"mu": 1.0, "lr": 0.05}]}]}
    spec = load_spec(second)
    db = run_sweep(spec, tmp_path, jobs=1)
    stale_point = json.dumps({"lr": 0.05, "mu": 0.1}, sort_keys=True)
    stale = old[stale_point]
    assert stale in {r["run_id"] for r in db.execute("SELECT run_id FROM runs WHERE status='done'")}
    assert ("fedprox", stale_point) not in planned_points(spec)
    # make the stale trial the best by far: it must still not be chosen
    (row,) = db.execute("SELECT summary FROM runs WHERE run_id=?", (stale,)).fetchall()
    s = json.loads(row["summary"])
    s["global/val_acc_mean_last10"] = 2.0
    db.execute("UPDATE runs SET summary=? WHERE run_id=?", (json.dumps(s), stale))
    db.commit()
    choice = select(db, spec)[("fedprox", "P6C3")]
    assert choice["params"]["mu"] in (0.01, 1.0) and choice["value"] <= 1.0
    assert len(json.loads(choice["row"]["means"])) == 2  # two trials, not three


# ---------------------------------------------------------------------------------------------
# Issue 44: failures cost rank, partial seeds are marked, one bold rule, ties by a stated rule


def _board(values, failed=None, seeds=3, chance=0.1):
    from fedskew.experiments.bench import Board

    labels = sorted({m for m, _ in values} | {m for m, _ in (failed or {})})
    settings = sorted({s for _, s in values} | {s for _, s in (failed or {})})
    ran = {k for k, v in values.items() if v}
    return Board("part", "global/test_acc_mean_last10", labels, settings, values, {}, {}, dict(failed or {}), ran,
                 seeds, chance)


def test_a_failed_setting_ranks_last_instead_of_improving_the_average_rank():
    """The audit's injection: two methods tied at an average rank; the one that fails its worst
    setting must not move ahead (before, its failed setting dropped out of its average)."""
    seeds = lambda v: {0: v, 1: v + 0.01, 2: v - 0.01}  # noqa: E731
    values = {("a", "s1"): seeds(0.8), ("b", "s1"): seeds(0.7), ("c", "s1"): seeds(0.6),
              ("a", "s2"): seeds(0.6), ("b", "s2"): seeds(0.7), ("c", "s2"): seeds(0.8)}
    board = _board(values)
    assert board.average_rank("a") == board.average_rank("c") == 2.0
    failed = {**values}
    del failed[("c", "s1")]  # c fails its worst setting
    board = _board(failed, failed={("c", "s1"): 3})
    assert board.ranks("s1") == {"a": 1, "b": 2, "c": 3}
    assert board.average_rank("c") == 2.0 and board.average_rank("a") == 2.0  # not 1.0 for c
    from fedskew.experiments.bench import board_rows, board_summary

    rows, record = board_rows(board, "a")
    row = next(r for r in rows if r[0] == "c")
    assert row[1] == "failed (3) (#3)"
    assert "Cells whose every run failed: 1 (c s1)" in board_summary(board, "a", record)


def test_a_board_where_every_method_ties_says_so_once():
    """Issue 54, item 20: "first ... fedavg, fedprox, logitadj (2.00); last: fedavg, fedprox,
    logitadj (2.00)" read as a ranking; a tie of all is one sentence."""
    from fedskew.experiments.bench import board_rows, board_summary

    same = {0: 0.5, 1: 0.5, 2: 0.5}
    board = _board({(m, "s"): dict(same) for m in ("fedavg", "fedprox", "logitadj")})
    text = board_summary(board, "fedavg", board_rows(board, "fedavg")[1])
    assert "All 3 ranked methods tie by average rank (2.00)." in text and "last:" not in text
    board = _board({("a", "s"): {0: 0.8, 1: 0.8, 2: 0.8}, ("b", "s"): dict(same)})
    assert "First by average rank: a (1.00); last: b (2.00)." in board_summary(board, None, {})


def test_the_summary_counts_the_methods_that_win_and_lose():
    """Issue 55: the prose's counts of methods winning or losing against the baseline come from the
    generator (tests/test_docs.py checks docs/leaderboard.md against them)."""
    from fedskew.experiments.bench import board_rows, board_summary

    base = {0: 0.50, 1: 0.52, 2: 0.51}
    shifted = lambda d: {k: v + d[k] for k, v in base.items()}  # noqa: E731
    board = _board(
        {
            ("fedavg", "s"): base,
            ("a", "s"): shifted({0: 0.10, 1: 0.11, 2: 0.10}),
            ("b", "s"): shifted({0: 0.09, 1: 0.10, 2: 0.09}),
            ("c", "s"): shifted({0: -0.10, 1: -0.12, 2: -0.10}),
            ("d", "s"): shifted({0: 0.01, 1: -0.02, 2: 0.0}),
        }
    )
    text = board_summary(board, "fedavg", board_rows(board, "fedavg")[1])
    assert "Significant wins against fedavg, 2 methods (settings): a (1), b (1); significant losses, 1 method: c (1)." \
        in text


def test_a_cell_with_missing_seeds_is_marked_and_none_is_not_ranked():
    from fedskew.experiments.bench import board_rows

    values = {("a", "s"): {0: 0.8, 1: 0.82}, ("b", "s"): {0: 0.5, 1: 0.52, 2: 0.51}, ("c", "s"): {}}
    board = _board(values)
    board.ran.add(("c", "s"))  # finished runs without the value: c has no such model
    rows, _ = board_rows(board, None)
    cells = {r[0]: r[1] for r in rows}
    assert cells["a"].endswith("(2/3 seeds)") and "(#1)" in cells["a"]  # (two seeds: not bold, issue 54)
    assert cells["c"] == "none" and "c" not in board.ranks("s")


def test_one_bold_rule_paired_test_one_seed_and_chance():
    from fedskew.experiments.report import bold_labels, build_table, paired_test

    best = {0: 0.80, 1: 0.82, 2: 0.81}
    near = {0: 0.795, 1: 0.825, 2: 0.80}  # differences +-: a tie by the paired test
    worse = {0: 0.70, 1: 0.71, 2: 0.705}  # consistently 10 points lower: a loss
    assert bold_labels({"best": best, "near": near, "worse": worse}) == {"best", "near"}
    assert bold_labels({"a": {0: 0.9}, "b": {0: 0.5}}) == set()  # one seed: nothing bold
    # two seeds: a paired t-test with 1 degree of freedom separates nothing (issue 54: 88.79 and 65.22 both bold)
    assert bold_labels({"a": {0: 0.8879, 1: 0.8879}, "b": {0: 0.6522, 1: 0.6621}}) == set()
    assert bold_labels({"a": {0: 0.095, 1: 0.094, 2: 0.095}, "b": {0: 0.09, 1: 0.09, 2: 0.09}}, chance=0.1) == set()
    assert bold_labels({"a": {0: 0.105, 1: 0.104, 2: 0.105}}, chance=0.1) == set()  # within one point of chance
    # the top group (issue 55): a higher, low-variance mean the test finds worse than the best stops the
    # walk, so a lower, high-variance mean below it is not bold either (before: bold, the higher one not)
    steady = {0: 0.78, 1: 0.80, 2: 0.79}  # 2 points under best, consistently: a loss
    noisy = {0: 0.60, 1: 0.95, 2: 0.70}  # mean 0.75, spread wide: a tie by the paired test
    assert paired_test(steady, best) == "L" and paired_test(noisy, best) == "T"
    assert bold_labels({"best": best, "steady": steady, "noisy": noisy}) == {"best"}
    # the report's tables use the same rule (values paired by position: the selected runs' seed order)
    t = build_table({("P", "x"): list(best.values()), ("P", "y"): list(worse.values())}, ["P"], ["x", "y"], None, 0.1)
    assert t["P"]["x"]["top"] and not t["P"]["y"]["top"]


def test_selection_ties_within_round_off_go_to_the_earlier_trial(tmp_path):
    """Two trials whose validation means differ by float round-off only: the first (the defaults)
    is chosen, not the one whose sum happened to round up."""
    import sqlite3

    from fedskew.experiments.sweep import select

    spec = load_spec({"name": "tie", "base": {"rounds": 1}, "seeds": [0],
                      "methods": [{"name": "fedprox", "trials": [{"mu": 0.01}, {"mu": 0.1}]}],
                      "selection": {"split": "validation"}})
    db = sqlite3.connect(tmp_path / "r.sqlite")
    db.row_factory = sqlite3.Row
    db.execute("CREATE TABLE runs (label, partition, params, seed, summary, status)")
    db.execute("CREATE TABLE selections (label, partition, params, metric, split, value, means)")
    for mu, value in ((0.01, 0.3 + 0.6), (0.1, 0.9)):  # 0.8999999999999999 vs 0.9
        db.execute("INSERT INTO runs VALUES ('fedprox', 'default', ?, 0, ?, 'done')",
                   (json.dumps({"mu": mu}, sort_keys=True), json.dumps({"global/val_acc_mean_last10": value})))
    assert 0.3 + 0.6 < 0.9
    assert select(db, spec)[("fedprox", "default")]["params"] == {"mu": 0.01}


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_a_tuned_sweep_in_worker_processes_is_one_pool_and_gives_the_sequential_results(tmp_path, monkeypatch):
    """jobs = 2 runs every method's grid, then its chosen point's other seeds, in one pool of
    workers (issue 55: a pool per method and phase restarted the workers 148 times in the lite
    suite, about 3 s each, with a worker idle at each phase's end): same runs, same results, same
    choices as jobs = 1, each method's other seeds planned from its whole grid."""
    import sqlite3

    from fedskew.experiments import sweep

    pools = []

    class Counted(sweep.WorkerPool):
        def __init__(self, *a, **k):
            pools.append(self)
            super().__init__(*a, **k)

    spec = load_spec(
        {
            **TINY,
            "methods": [
                {"name": "fedavg", "trials": [{"lr": 0.05}, {"lr": 0.01}]},
                {"name": "fedprox", "trials": [{"mu": 0.01, "lr": 0.05}, {"mu": 0.1, "lr": 0.01}]},
                {"name": "scaffold", "trials": [{"lr": 0.05}, {"lr": 0.02}]},
            ],
            "seeds": [0, 1],
            "selection": {"split": "validation", "validation_fraction": 0.2, "tune_seeds": [0]},
        }
    )
    run_sweep(spec, tmp_path / "one", jobs=1).close()
    monkeypatch.setattr(sweep, "WorkerPool", Counted)
    run_sweep(spec, tmp_path / "two", jobs=2).close()
    assert len(pools) == 1
    got = {}
    for name in ("one", "two"):
        db = sqlite3.connect(tmp_path / name / "results.sqlite")
        got[name] = ({r[0]: (r[1], json.loads(r[2])["global/test_acc"]) for r in
                      db.execute("SELECT run_id, status, summary FROM runs")},
                     sorted(db.execute("SELECT label, partition, params, value FROM selections")))
    assert got["one"] == got["two"]
    assert len(got["two"][0]) == 3 * (2 + 1) and {s for s, _ in got["two"][0].values()} == {"done"}
    assert len(got["two"][1]) == 3


def test_a_board_names_the_options_that_act_in_none_of_a_method_s_runs(tmp_path):
    """CFL's default start_round (20) is the lite suite's rounds: no cluster ever splits, every run
    of it is FedAvg's, and its board says so beside the cells (issue 55); a method whose runs all
    act is not named."""
    import warnings

    from fedskew.config import InertOptionWarning
    from fedskew.experiments.bench import inert_options

    spec = load_spec({**TINY, "methods": ["fedavg", "cfl", {"name": "ghbm", "trials": [{"tau": 1}]}]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InertOptionWarning)
        run_sweep(spec, tmp_path / "label-skew-fmnist", jobs=1).close()
    assert inert_options("label-skew", tmp_path) == {
        "cfl": "start_round = 20 is not below rounds = 2: no cluster is ever split, so this run is FedAvg"}


def test_rank_agreement_against_hand_computed_kendall_taus():
    """How far two boards rank the same methods alike (the lite board against the paper-scale
    campaign): Kendall's tau-b, its p-value and the methods that move most, by hand."""
    from fedskew.experiments.bench import rank_agreement

    # 4 common methods (x and y are on one board only), one discordant pair of 6:
    # tau = (5 - 1) / 6; exact p: 4 of the 24 orders have at most one inversion, two-sided 2 * 4 / 24
    got = rank_agreement({"a": 0.4, "b": 0.3, "c": 0.2, "d": 0.1, "x": 0.9},
                         {"a": 0.4, "b": 0.3, "c": 0.1, "d": 0.2, "y": 0.0})
    assert got.n == 4 and got.tau == pytest.approx(2 / 3) and got.p == pytest.approx(1 / 3)
    assert got.moves == [("c", 3.0, 4.0), ("d", 4.0, 3.0)]
    assert "fewer than 5 methods" in got.sentence("lite", "paper")
    assert "c (#3 lite, #4 paper)" in got.sentence("lite", "paper")
    # a tie on the first board (c = d): tau-b = 5 concordant / sqrt((6 - 1) * (6 - 0))
    tied = rank_agreement({"a": 4, "b": 3, "c": 1, "d": 1}, {"a": 4, "b": 3, "c": 2, "d": 1})
    assert tied.tau == pytest.approx(5 / 30 ** 0.5) and tied.moves == [("c", 3.5, 3.0), ("d", 3.5, 4.0)]
    # reversed order of 6: tau -1, exact p 2 / 720; the largest moves first, then by name
    rev = rank_agreement({m: i for i, m in enumerate("abcdef")}, {m: -i for i, m in enumerate("abcdef")})
    assert rev.tau == pytest.approx(-1) and rev.p == pytest.approx(2 / 720)
    assert [m for m, _, _ in rev.moves] == ["a", "f", "b"] and "fewer than 5" not in rev.sentence("x", "y")
    assert rank_agreement({"a": 1, "b": 2}, {"a": 1, "b": 2}) is None  # fewer than 3 common methods
    assert rank_agreement({"a": 1, "b": 1, "c": 1}, {"a": 1, "b": 2, "c": 3}) is None  # all tied: undefined


def _written_board(values):
    """A board as `fedskew bench` writes it (leaderboard.md), from seeds' values."""
    from fedskew.experiments.bench import board_sections
    from fedskew.experiments.report import to_markdown

    board = _board(values)
    board.part = "map"
    return to_markdown("board", board_sections(board), Path("."))


def test_board_agreement_joins_the_campaign_steps_and_reads_written_boards():
    from fedskew.experiments.bench import board_agreement, column_means

    seeds = lambda v: {0: v, 1: v + 0.01, 2: v - 0.01}  # noqa: E731
    lite = _written_board({(m, "s"): seeds(v) for m, v in zip("abcde", (0.9, 0.8, 0.7, 0.6, 0.5))})
    part = _written_board({(m, "s"): seeds(v) for m, v in zip("ab", (0.7, 0.9))})  # a and b swapped
    rest = _written_board({(m, "s"): seeds(v) for m, v in zip("cde", (0.6, 0.5, 0.4))})
    (line,) = board_agreement([part, rest], lite, "at paper scale", "on the lite board")
    # 5 methods, one discordant pair of 10: tau = 0.8; exact two-sided p = 2 * 5 / 120
    assert line.startswith("map: global accuracy (test set, mean of the last 10 rounds), s: Kendall's tau-b 0.80, "
                           "p = 0.083 over the 5 methods")
    assert "a (#2 at paper scale, #1 on the lite board); b (#1 at paper scale, #2 on the lite board)" in line
    assert board_agreement([part], lite, "p", "l") == []  # 2 common methods: nothing to say
    with pytest.raises(ConfigError, match="b has a mean in 'map: global accuracy .*', s, on two of the boards"):
        board_agreement([part, part], lite, "p", "l")
    # a row that a board shows beside its own (`--beside`) is not its own
    header, rows = ["method", "s", "avg rank", "W/T/L vs -"], [["a", "**90.00 +- 1.00 (#1)**", "1.00", "-"],
                                                              ["z (board)", "80.00 +- 1.00 (#2)", "2.00", "-"],
                                                              ["y", "failed (3) (#3)", "3.00", "-"]]
    assert column_means(rows, header.index("s")) == {"a": 90.0}
    # `--beside`: this board's own rows against the committed board's, in the table's text and the console
    from fedskew.experiments.bench import beside, board_sections

    mine = _board({(m, "s"): seeds(v) for m, v in zip("abc", (0.7, 0.9, 0.8))})
    mine.part = "map"
    sections = board_sections(mine)
    said = beside(sections, lite, "the lite board")
    # a b c here: b, c, a (ranks 3, 1, 2); there a, b, c: two discordant pairs of 3, tau = -1/3
    assert said[-1].endswith("s: Kendall's tau-b -0.33, p = 1 over the 3 methods both rank (with fewer than 5 "
                             "methods no ranking can reach p < 0.05); moved most (rank among them): a (#3 here, #1 "
                             "there); b (#1 here, #2 there); c (#2 here, #3 there).")
    assert "How far the two boards rank the methods both ran alike: s: Kendall's tau-b -0.33" in sections[0].text
    assert [r[0] for r in sections[0].rows] == ["b", "c", "a", "d (board)", "e (board)"]
