"""Sweeps, the results database, hyper-parameter selection, reports and reproduction presets."""

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import yaml

from fedskew.cli import main
from fedskew.config import ConfigError, validate_config
from fedskew.experiments.presets import PAPERS, reproduction
from fedskew.experiments.report import build_table, mean_curve, rounds_to_target, write_report
from fedskew.experiments.sweep import grid_points, load_spec, plan, run_identity, run_sweep

TINY = {"name": "tiny", "base": {"rounds": 2, "local_epochs": 1, "partition": {"num_clients": 6},
                                 "clients_per_round": 3, "model": {"name": "mlp", "hidden": [16]},
                                 "checkpoint_every": 1},
        "methods": ["fedavg", {"name": "fedprox", "options": {"mu": [0.1, 0.001]}}],
        "partitions": {"P6C3": {"name": "pcdd", "classes_per_client": 3}, "Dir": {"name": "dirichlet",
                                                                                  "alpha": 1.0, "min_size": 5}},
        "seeds": [0, 1]}


# -- tables and curves by hand ---------------------------------------------------------------------


def test_table_builder_on_hand_made_results():
    cells = {("P1", "fedavg"): [0.5, 0.7], ("P1", "m"): [0.8, 0.6, 0.7], ("P1", "x"): [None],
             ("P2", "fedavg"): [0.9], ("P2", "m"): [0.9], ("P2", "x"): [0.3]}
    t = build_table(cells, ["P1", "P2"], ["fedavg", "m", "x"], baseline="fedavg")
    a, m, x = t["P1"]["fedavg"], t["P1"]["m"], t["P1"]["x"]
    assert a["mean"] == pytest.approx(0.6) and a["std"] == pytest.approx(0.141421356, abs=1e-8) and a["n"] == 2
    assert m["mean"] == pytest.approx(0.7) and m["std"] == pytest.approx(0.1) and m["n"] == 3
    assert m["best"] and not a["best"] and not x["best"] and x["mean"] is None
    assert m["gain_baseline"] == pytest.approx(0.1) and a["gain_baseline"] is None
    assert m["gain_best_other"] == pytest.approx(0.1) and a["gain_best_other"] == pytest.approx(-0.1)
    # a tie marks both; a single seed has std 0
    assert t["P2"]["fedavg"]["best"] and t["P2"]["m"]["best"] and t["P2"]["fedavg"]["std"] == 0.0
    assert t["P2"]["x"]["gain_baseline"] == pytest.approx(-0.6) and t["P2"]["m"]["gain_best_other"] == pytest.approx(0)


def test_rounds_to_target_on_a_hand_made_curve():
    curve = [(0, 0.1), (1, 0.5), (2, 0.4), (3, 0.6)]
    assert rounds_to_target(curve, 0.5) == 2  # reached after round index 1, i.e. 2 rounds
    assert rounds_to_target(curve, 0.6) == 4
    assert rounds_to_target(curve, 0.7) is None
    hist = [[{"round": 0, "a": 0.2}, {"round": 1, "a": 0.4}], [{"round": 0, "a": 0.4}, {"round": 1, "a": None}]]
    assert mean_curve(hist, "a") == [(0, pytest.approx(0.3))]  # round 1 lacks a value in one run


def test_grid_points_and_spec_errors():
    assert grid_points({"a": [1, 2], "b": 3, "c": ["x", "y"]}) == [
        {"a": 1, "b": 3, "c": "x"}, {"a": 1, "b": 3, "c": "y"}, {"a": 2, "b": 3, "c": "x"}, {"a": 2, "b": 3, "c": "y"}]
    with pytest.raises(ConfigError, match="sweep key 'method' is not known"):
        load_spec({"method": ["fedavg"]})
    with pytest.raises(ConfigError, match="sweep key 'methods' is missing"):
        load_spec({"seeds": [0]})
    with pytest.raises(ConfigError, match="appear twice"):
        load_spec({"methods": ["fedavg", "fedavg"]})
    with pytest.raises(ConfigError, match="method.mu2 is not an option of fedprox"):
        plan(load_spec({"methods": [{"name": "fedprox", "options": {"mu2": 1}}]}))


def test_run_ids_survive_new_config_keys():
    """A run's id hashes its resolved config, so a key added to the schema would give every finished
    run of every sweep a new id and rerun it (adding FedCP's model.conditional_policy did so to a
    1,524-run bench). Keys added later drop out of the identity at their as-before value (keys that
    left the schema are put back at the value they had: tests/test_structure.py). The id below is the
    one this run had before model.conditional_policy existed: a new key missing from
    spec.ADDED_KEYS changes it, and so does a changed default (then the new id is right: pin it)."""
    spec = load_spec({**TINY, "methods": ["fedavg"], "partitions": {"P6C3": TINY["partitions"]["P6C3"]},
                      "seeds": [0], "selection": {"split": "test"}})  # (no hold-out: the config the id was pinned for)
    assert [r["run_id"] for r in plan(spec)] == ["adbac09082b3"]
    cfg = plan(spec)[0]["config"]
    assert cfg["model"]["dropout"] == 0.0 and "dropout" not in run_identity(cfg)["model"]
    on = {**cfg, "model": {**cfg["model"], "dropout": 0.5}}
    assert run_identity(on)["model"]["dropout"] == 0.5  # away from its as-before value: part of the id


# -- running, resuming, selecting ------------------------------------------------------------------


def statuses(folder):
    db = sqlite3.connect(folder / "results.sqlite")
    return {r[0]: (r[1], r[2]) for r in db.execute("SELECT run_id, status, finished FROM runs")}


def test_sweep_records_every_run_and_skips_finished_ones(tmp_path):
    spec = load_spec(TINY)
    events = []
    run_sweep(spec, tmp_path, jobs=1, on_event=lambda kind, r: events.append(kind)).close()
    first = statuses(tmp_path)
    assert len(first) == 3 * 2 * 2 and all(s == "done" for s, _ in first.values())
    assert events.count("done") == 12
    db = sqlite3.connect(tmp_path / "results.sqlite")
    assert db.execute("SELECT COUNT(*) FROM rounds").fetchone()[0] == 12 * 2
    # again: nothing runs, nothing changes
    events.clear()
    run_sweep(spec, tmp_path, jobs=1, on_event=lambda kind, r: events.append(kind)).close()
    assert events == ["skipped"] * 12 and statuses(tmp_path) == first
    # a run left 'running' (the process died) is resumed from its directory, and only it
    victim = sorted(first)[0]
    db.execute("UPDATE runs SET status='running', summary=NULL WHERE run_id=?", (victim,))
    db.commit()
    events.clear()
    run_sweep(spec, tmp_path, jobs=1, on_event=lambda kind, r: events.append(kind)).close()
    assert events.count("done") == 1 and events.count("skipped") == 11
    after = statuses(tmp_path)
    assert after[victim][0] == "done" and all(after[k] == first[k] for k in first if k != victim)


def test_selection_picks_the_best_mean_over_seeds_and_records_it(tmp_path):
    db = run_sweep(load_spec({**TINY, "selection": {"split": "test"}}), tmp_path, jobs=1)
    rows = db.execute("SELECT partition, params, summary FROM runs WHERE label='fedprox'").fetchall()
    for partition in ("P6C3", "Dir"):
        means = {}
        for p, params, summary in rows:
            if p == partition:
                means.setdefault(params, []).append(json.loads(summary)["global/test_acc_mean_last10"])
        best = max(means, key=lambda k: sum(means[k]) / len(means[k]))
        sel = db.execute("SELECT params, metric, split FROM selections WHERE label='fedprox' AND partition=?",
                         (partition,)).fetchone()
        assert tuple(sel) == (best, "global/test_acc_mean_last10", "test")


def test_selection_on_a_validation_split(tmp_path):
    spec = load_spec({**TINY, "methods": [{"name": "fedprox", "options": {"mu": [0.1, 0.001]}}],
                      "partitions": {"P6C3": {"name": "pcdd"}}, "seeds": [0],
                      "selection": {"split": "validation", "validation_fraction": 0.2}})
    db = run_sweep(spec, tmp_path, jobs=1)
    config, summary = tuple(db.execute("SELECT config, summary FROM runs LIMIT 1").fetchone())
    assert json.loads(config)["dataset"]["validation_fraction"] == 0.2
    assert json.loads(summary)["global/val_acc_mean_last10"] is not None
    assert tuple(db.execute("SELECT metric, split FROM selections").fetchone()) == ("global/val_acc_mean_last10",
                                                                                      "validation")


def test_personal_validation_score_is_the_class_weighted_hold_out_accuracy(tmp_path):
    """``val_accuracies``: a personal model's accuracy on the validation hold-out weighted to its
    client's training label frequencies, against a numpy replay from the model's predictions; both
    executors give it."""
    import numpy as np
    import torch

    from fedskew.engine.runner import Experiment
    from fedskew.models.functional import predict

    cfg = {"method": "fedrep", "rounds": 1, "dataset": {"validation_fraction": 0.2}, "partition": {"num_clients": 4},
           "clients_per_round": 2, "model": {"name": "mlp", "hidden": [8]}}
    for executor in ("sequential", "vectorized"):
        exp = Experiment(validate_config({**cfg, "executor": executor}), tmp_path / executor)
        runner, fed = exp.executor, exp.fed
        states = [{k: v + 0.1 * (i + 1) * torch.randn_like(v) for k, v in exp.model.state_dict().items()}
                  for i in range(2)]
        got = runner.val_accuracies(states, [0, 3])
        x, y = fed.data.x_val, fed.data.y_val.numpy()
        for state, k, value in zip(states, [0, 3], got):
            hit = predict(exp.model, state, x).numpy() == y
            counts = np.bincount(fed.data.y_train[fed.train_idx[k]].numpy(), minlength=fed.num_classes)
            acc = {c: hit[y == c].mean() for c in np.unique(y)}
            want = sum(counts[c] * a for c, a in acc.items()) / sum(counts[c] for c in acc)
            assert abs(value - want) < 1e-9, (executor, k, value, want)


def test_a_method_without_a_global_model_is_selected_by_its_personal_models_on_the_hold_out(tmp_path):
    """FedRep has no global model; on a validation split its grid is chosen by
    personal/final_val_acc_after (recorded as the selection's metric), never by a test metric."""
    spec = load_spec({**TINY, "methods": [{"name": "fedrep", "trials": [{"lr": 0.003}, {"lr": 0.1}]}],
                      "partitions": {"P6C3": {"name": "pcdd"}}, "seeds": [0],
                      "selection": {"split": "validation", "validation_fraction": 0.2}})
    db = run_sweep(spec, tmp_path, jobs=1)
    scores = {json.loads(c)["lr"]: json.loads(s)["personal/final_val_acc_after"]
              for c, s in db.execute("SELECT config, summary FROM runs")}
    assert len(scores) == 2 and None not in scores.values()
    metric, params = db.execute("SELECT metric, params FROM selections").fetchone()
    assert metric == "personal/final_val_acc_after"
    assert json.loads(params)["lr"] == max(scores, key=scores.get)


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_a_killed_sweep_resumes_to_the_uninterrupted_result(tmp_path):
    spec = {**TINY, "base": {**TINY["base"], "rounds": 4}, "methods": ["fedavg", "fedprox"],
            "partitions": {"P6C3": {"name": "pcdd"}}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fedskew.cli", "sweep", str(path), "--out", str(tmp_path / "killed"), "--jobs", "1",
           "--no-report"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # kill once one run is done and the next has written a checkpoint
            st = statuses(tmp_path / "killed") if (tmp_path / "killed" / "results.sqlite").exists() else {}
            running = [k for k, (s, _) in st.items() if s == "running"]
            if any(s == "done" for s, _ in st.values()) and running and \
                    (tmp_path / "killed" / "runs" / running[0] / "checkpoint.pt").exists():
                break
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert any(s != "done" for s, _ in statuses(tmp_path / "killed").values())
    assert subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    run_sweep(load_spec(spec), tmp_path / "clean", jobs=1).close()
    results = {}
    for name in ("killed", "clean"):
        db = sqlite3.connect(tmp_path / name / "results.sqlite")
        results[name] = {
            r[0]: json.loads(r[1])["global/test_acc"] for r in db.execute("SELECT run_id, summary FROM runs")
        }
    assert results["killed"] == results["clean"] and len(results["clean"]) == 4


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_parallel_jobs_give_the_sequential_results(tmp_path):
    spec = load_spec({**TINY, "partitions": {"P6C3": {"name": "pcdd"}}, "seeds": [0]})
    one = run_sweep(spec, tmp_path / "one", jobs=1)
    two = run_sweep(spec, tmp_path / "two", jobs=2)
    def get(db):
        return {r[0]: json.loads(r[1])["global/test_acc"] for r in db.execute("SELECT run_id, summary FROM runs")}
    assert get(one) == get(two)


# -- the report --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    folder = tmp_path_factory.mktemp("swept")
    spec = load_spec({**TINY, "base": {**TINY["base"], "rounds": 4}})
    run_sweep(spec, folder, jobs=1).close()
    write_report(folder)
    return folder


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_report_markdown_has_the_papers_layout(swept):
    md = (swept / "report" / "report.md").read_text()
    assert "| partition | fedavg | fedprox |" in md and "| P6C3 |" in md and "| Dir |" in md
    assert "gain over fedavg" in md and "Rounds to reach 95% of fedavg's best accuracy" in md
    assert "Hyper-parameters chosen" in md and '{"mu":' in md
    for png in ("curves_p0.png", "partition_p0.png", "classes_p0.png", "fairness_p0.png"):
        assert (swept / "report" / png).is_file() and f"]({png})" in md
    # the bold cell is the row's best mean, computed from the database
    db = sqlite3.connect(swept / "results.sqlite")
    sel = dict(db.execute("SELECT label, params FROM selections WHERE partition='P6C3'").fetchall())
    means = {}
    for label, params, summary in db.execute("SELECT label, params, summary FROM runs WHERE partition='P6C3'"):
        if params == sel[label]:
            means.setdefault(label, []).append(json.loads(summary)["global/test_acc_mean_last10"])
    best = max(means, key=lambda k: sum(means[k]) / len(means[k]))
    row = next(line for line in md.splitlines() if line.startswith("| P6C3 |"))
    cells = dict(zip(["fedavg", "fedprox"], row.strip("|").split("|")[1:]))
    # (this sweep's two seeds: nothing is bold below three, issue 54; with three the best would be)
    assert len(means[best]) == 2 and not any(c.strip().startswith("**") for c in cells.values())
    assert "nothing is bold with fewer than 3 seeds" in md


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium is not installed (apt-get install chromium)")
def test_html_report_renders_in_headless_chromium(swept, tmp_path):
    page = (swept / "report" / "report.html").resolve()
    flags = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000"]
    shot = tmp_path / "report.png"
    subprocess.run(flags + [f"--screenshot={shot}", "--window-size=1200,2400", page.as_uri()], check=True,
                   capture_output=True, timeout=120)
    dom = subprocess.run(flags + ["--dump-dom", page.as_uri()], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    images = dom.count("<img")
    assert "<table" in dom and "fedprox" in dom and images >= 4
    assert f'data-images-loaded="{images}"' in dom  # every embedded plot decoded
    from PIL import Image

    with Image.open(shot) as img:
        assert img.size == (1200, 2400)
        assert len(img.convert("RGB").getcolors(maxcolors=1 << 20) or []) > 50  # not a blank page


def test_a_full_disk_during_a_report_is_one_sentence_and_leaves_no_broken_image(swept, tmp_path, monkeypatch):
    """ENOSPC half-way through a PNG (matplotlib wrote some bytes): one sentence, and every image of
    the earlier report is still whole (before: 0-byte and truncated PNGs)."""
    import errno

    from matplotlib.figure import Figure
    from PIL import Image

    from fedskew.engine.rundir import StorageError

    out = tmp_path / "rep"
    write_report(swept, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = Figure.savefig
    calls = []

    def fill_the_disk(self, fname, **kw):
        calls.append(1)
        if len(calls) < 2:
            return real(self, fname, **kw)
        fname.write(b"\x89PNG\r\n")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", fill_the_disk)
    with pytest.raises(StorageError, match=r"writing the report into '.*rep' failed \(No space left on device\); "
                                           r"free space, or write it elsewhere with `fedskew report .* --out DIR`"):
        write_report(swept, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(before)  # no .tmp left behind
    for p in out.glob("*.png"):
        with Image.open(p) as img:
            img.verify()
    assert (out / "report.md").read_bytes() == before["report.md"]
    monkeypatch.undo()
    assert main(["report", str(swept), "--out", str(tmp_path / "ro" / "x")]) == 0
    monkeypatch.setattr(os, "mkdir", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only file "
                                                                                                "system")))
    with pytest.raises(StorageError, match=r"\(Read-only file system\); free space, or write it elsewhere"):
        write_report(swept, tmp_path / "new")


def test_report_plots_tell_methods_apart_and_count_rounds_in_whole_numbers(swept, monkeypatch):
    """Twelve methods: twelve different line styles, thin bands, integer round ticks; 62 classes
    (FEMNIST) label every fifth class so the labels do not overlap."""
    from fedskew.experiments import plots
    from fedskew.experiments.selection import selected_runs
    from fedskew.experiments.store import open_sweep

    styles = plots.styles(12)
    assert len({(s["color"], s["ls"]) for s in styles}) == 12 and len({s["color"] for s in styles}) == 12
    assert len({(s["color"], s["ls"]) for s in plots.styles(45)}) == 45
    figures = []
    monkeypatch.setattr(plots, "save_png", lambda fig, path, dpi=100: figures.append(fig) or path)
    res = selected_runs(open_sweep(swept), yaml.safe_load((swept / "sweep.yaml").read_text()))
    part = res.partitions[0]
    res.labels = [f"m{i}" for i in range(12)]
    res.runs = {(f"m{i}", part): res.runs[("fedavg", part)] for i in range(12)}
    plots.plot_curves(res, part, "global/test_acc", swept / "unused.png")
    ax = figures[-1].axes[0]
    assert len({(line.get_color(), line.get_linestyle()) for line in ax.get_lines()}) == 12
    assert all(float(t).is_integer() for t in ax.get_xticks())
    assert all(c.get_alpha() <= 0.1 for c in ax.collections)
    for r in res.runs[("m0", part)]:
        r.summary = {**r.summary, **{f"global/class_acc/{c}": 0.5 for c in range(62)}}
    plots.plot_class_accuracy(res, part, swept / "unused.png")
    assert len(figures[-1].axes[0].get_xticks()) == 13  # 0, 5, ..., 60

    import torch

    from fedskew.data import federated
    from fedskew.data.datasets import Dataset

    y = torch.arange(620) % 62
    data = Dataset("femnist", torch.zeros(620, 1), y, torch.zeros(62, 1), y[:62], 62)
    fig = federated.Federation(data, [torch.arange(k, 620, 10) for k in range(10)], [torch.arange(0)] * 10).heatmap()
    assert len(fig.axes[0].get_xticks()) == 13


def test_report_of_a_folder_that_is_not_a_sweep(tmp_path):
    with pytest.raises(ConfigError, match="not a sweep folder"):
        write_report(tmp_path)


# -- presets ---------------------------------------------------------------------------------------


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
@pytest.mark.parametrize("name", sorted(PAPERS))
def test_reproduce_smoke_runs_every_preset(tmp_path, name, capsys):
    assert main(["reproduce", name, "--scale", "smoke", "--out", str(tmp_path / name), "--jobs", "1"]) == 0
    assert {s for s, _ in statuses(tmp_path / name).values()} == {"done"}
    lines = (tmp_path / name / "report" / "report.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| partition |"))
    assert (
        header == "| partition | " + " | ".join(m.column for m in load_spec(reproduction(name, "smoke")).methods) + " |"
    )
    # one seed: a smoke test says so, shows no "+- 0.00" and bolds no winner
    out = capsys.readouterr().out
    assert "smoke test" in out and "says nothing about the methods" in out and "nothing is bold" in out
    table = [line for line in lines if line.startswith("| ") and "(1 seed)" in line]
    assert table and not any("**" in line or "+- 0.00" in line for line in table)


@pytest.mark.parametrize("name", sorted(PAPERS))
def test_paper_and_lite_presets_are_valid_specs(name):
    for scale in ("lite", "paper"):
        spec = load_spec(reproduction(name, scale, "/data"))
        runs = plan(spec)  # every run config validates (method options, models, partitions)
        assert runs and all(r["config"]["dataset"]["root"] == "/data" for r in runs)
    with pytest.raises(ConfigError, match="allowed"):
        reproduction(name, "huge")
    with pytest.warns(FutureWarning, match="--scale small is now called lite"):  # the name before 0.2
        assert reproduction(name, "small", "/data") == reproduction(name, "lite", "/data")


@pytest.mark.parametrize("scale,per_class", [("lite", 1200), ("paper", 5000)])  # 20% of FMNIST; CIFAR-10
def test_label_count_presets_fit_their_data(scale, per_class):
    import numpy as np

    from fedskew.config import PartitionConfig
    from fedskew.data.partitions import partition_labels
    from fedskew.streams import numpy_rng

    labels = np.repeat(np.arange(10), per_class)
    for p in reproduction("etf", scale)["partitions"].values():
        for seed in range(3):
            parts = partition_labels(PartitionConfig(**p), labels, 10, numpy_rng(seed, "partition"))
            assert all(len(x) == p["classes_per_client"] * p["samples_per_class"] for x in parts)
