"""The public Python API (``import fedskew``) and the package layout's one-way dependencies."""

import ast
import json
import os
import pydoc
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fedskew
from fedskew.algorithms import BUILTIN, METHODS
from fedskew.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"rounds": 3, "partition.num_clients": 6, "clients_per_round": 3, "local_epochs": 1, "model.hidden": [32]}
SMALL_ARGS = [f"{k}={json.dumps(v)}" for k, v in SMALL.items()]


@pytest.fixture(autouse=True)
def one_thread():
    """Bitwise comparisons with other processes need the same thread count (the CLI run below
    and the sweep workers use one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def user_methods():
    """Registered-method tests leave the registry as they found it."""
    before = dict(METHODS)
    yield
    METHODS.clear()
    METHODS.update(before)


def records(path: Path) -> list[dict]:
    """metrics.jsonl without wall-clock values."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
            for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# fedskew.run / load_config / resume


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_run_with_overrides_equals_the_cli_run(tmp_path):
    """The same config given as CLI arguments (a real `fedskew run` process) and to fedskew.run
    as a YAML path + keyword + mapping overrides: identical records, summary and final model."""
    yaml_file = tmp_path / "base.yaml"
    yaml_file.write_text("method: {name: fedprox, mu: 0.01}\npartition: {name: pcdd, classes_per_client: 2}\n")
    cli_args = [str(yaml_file), *SMALL_ARGS, "method.mu=0.1", f"out_dir={tmp_path}", "run_name=cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "fedskew.cli", "run", *cli_args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr

    result = fedskew.run(yaml_file, {"method.mu": 0.1, "run_name": "api"}, out_dir=str(tmp_path),
                         **{k: v for k, v in SMALL.items()})
    assert result.run_dir == tmp_path / "api"
    assert records(tmp_path / "cli" / "metrics.jsonl") == records(tmp_path / "api" / "metrics.jsonl")
    cli_summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert {k: v for k, v in cli_summary.items() if not k.startswith("time/")} == \
        {k: v for k, v in result.summary.items() if not k.startswith("time/")}
    ckpt = torch.load(tmp_path / "cli" / "checkpoint.pt", weights_only=True)
    assert ckpt["global_state"].keys() == result.global_state.keys()
    assert all(torch.equal(ckpt["global_state"][k], v) for k, v in result.global_state.items())
    # what the result carries beside the files
    assert result.config.method.options == {"mu": 0.1} and result.config.partition.classes_per_client == 2
    assert result.curve() == [(h["round"], h["global/test_acc"]) for h in result.history]
    x = torch.randn(4, 64)
    assert torch.equal(result.model(x), torch.func.functional_call(result.model, result.global_state, (x,)))
    assert "fedprox on digits/pcdd" in repr(result) and "tensor" not in repr(result)


def test_load_config_takes_every_form_of_a_config(tmp_path):
    cli = load_config("examples/fedavg_digits.yaml", ["rounds=7", "partition.classes_per_client=2", "method=map"])
    assert (
        fedskew.load_config("examples/fedavg_digits.yaml", ["rounds=7", "partition.classes_per_client=2"], method="map")
        == cli
    )
    assert fedskew.load_config(ROOT / "examples/fedavg_digits.yaml", {"partition.classes_per_client": 2}, rounds=7,
                               method="map") == cli
    assert fedskew.load_config(cli) == cli  # a RunConfig passes through
    assert fedskew.load_config({"method": "map", "rounds": 7}).model.classifier_bias is False  # method model defaults
    assert fedskew.load_config(None, rounds=7).rounds == 7
    with pytest.raises(ConfigError, match="config key 'rounds' = 0 is not allowed"):
        fedskew.run(rounds=0)
    with pytest.raises(ConfigError, match="method.name 'nope' is not known"):
        fedskew.run({"method": "nope"})
    with pytest.raises(ConfigError, match="config must be a mapping, a YAML path or a RunConfig, not a int"):
        fedskew.run(42)
    with pytest.raises(ConfigError, match="config file '.*missing.yaml' does not exist"):
        fedskew.run(tmp_path / "missing.yaml")


def test_resume_continues_an_interrupted_run_exactly(tmp_path):
    full = fedskew.run(out_dir=str(tmp_path), run_name="full", final_personalization=False, **SMALL)

    class Stop(Exception):
        pass

    def stop_after_round_1(record):
        if record["round"] == 1:
            raise Stop  # as a crash after the round's checkpoint

    with pytest.raises(Stop):
        fedskew.run(out_dir=str(tmp_path), run_name="cut", final_personalization=False, on_round=stop_after_round_1,
                    **SMALL)
    seen = []
    resumed = fedskew.resume(tmp_path / "cut", on_round=seen.append)
    assert [r["round"] for r in seen] == [2]
    assert records(tmp_path / "cut" / "metrics.jsonl") == records(tmp_path / "full" / "metrics.jsonl")
    assert all(torch.equal(full.global_state[k], v) for k, v in resumed.global_state.items())


# ---------------------------------------------------------------------------------------------
# A method from outside the package

USER_MODULE = '''
import torch
import torch.nn.functional as F
from pydantic import Field

import fedskew
from fedskew.algorithms.base import FedAvgOptions, as_model_part, model_part


class ShrinkOptions(FedAvgOptions):
    beta: float = Field(0.5, ge=0, le=1)


@fedskew.register_method
class Shrink(fedskew.Method):
    """Label-smoothed CE towards the client's own classes, a per-client counter kept across rounds,
    and a server step that moves only beta of the way to the average."""

    Options = ShrinkOptions

    def client_init(self, client_id, global_state, info):
        counts = info.class_counts[client_id].float()
        return {"shrink.prior": counts / counts.sum(), "shrink.visits": torch.zeros(())}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        ce = F.cross_entropy(logits, y)
        smooth = -(client_state["shrink.prior"] * F.log_softmax(logits, 1)).sum(1).mean()
        return 0.9 * ce + 0.1 * smooth, {"shrink/smooth": smooth.detach()}

    def after_training(self, trained, payload, client_state, report):
        return as_model_part(trained), {**client_state, "shrink.visits": client_state["shrink.visits"] + 1}

    def aggregate(self, server_state, global_state, uploads, reports):
        avg, server = super().aggregate(server_state, global_state, uploads, reports)
        b = self.opt.beta
        return {k: (1 - b) * global_state[k] + b * v if v.is_floating_point() else v for k, v in avg.items()}, server
'''


def import_user_module(tmp_path, name="user_methods_mod"):
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    sys.path.insert(0, str(tmp_path))
    try:
        __import__(name)
    finally:
        sys.path.remove(str(tmp_path))
    return sys.modules.pop(name)


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_a_registered_method_runs_on_both_executors_and_in_a_sweep(tmp_path, user_methods, monkeypatch):
    module = import_user_module(tmp_path)
    assert fedskew.methods()["shrink"] is module.Shrink and "shrink" not in BUILTIN
    base = {**SMALL, "method": {"name": "shrink", "beta": 0.7}, "out_dir": str(tmp_path),
            "final_personalization": False}
    seq = fedskew.run(base, run_name="seq")
    vec = fedskew.run(base, run_name="vec", executor="vectorized")
    assert seq.history[-1]["train/shrink/smooth"] > 0
    for k, v in seq.global_state.items():
        torch.testing.assert_close(vec.global_state[k], v, atol=1e-5, rtol=0)
    fedavg = fedskew.run({**base, "method": "fedavg"}, run_name="fedavg")
    assert not all(torch.equal(fedavg.global_state[k], v) for k, v in seq.global_state.items())

    # a sweep with spawned workers, which find the method through its module (on sys.path here)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = {"name": "user", "base": {k: v for k, v in base.items() if k != "out_dir"},
            "methods": [{"name": "shrink", "options": {"beta": [0.7, 1.0]}}, "fedavg"], "seeds": [0],
            "selection": {"split": "test"}}  # (no hold-out: the sweep's run is the run above)
    events = []
    sweep_dir = fedskew.sweep(spec, jobs=2, out=tmp_path / "sweep", on_event=lambda kind, r: events.append(kind))
    assert events.count("done") == 3
    rows = fedskew.load_results(sweep_dir, frame=False)
    shrink = {r["option/beta"]: r for r in rows if r["method"] == "shrink"}
    assert all(r["status"] == "done" for r in rows) and set(shrink) == {0.7, 1.0}
    assert shrink[0.7]["global/test_acc"] == seq.summary["global/test_acc"]  # the worker ran the same run
    md, html = fedskew.report(sweep_dir)
    assert "shrink" in md.read_text() and html.is_file()


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_a_script_registering_a_method_sweeps_with_spawned_workers(tmp_path):
    """The documented pattern: a script registers its method at top level and runs the sweep under
    ``if __name__ == "__main__":``; spawn re-imports the script in each worker (a real process)."""
    script = tmp_path / "study.py"
    script.write_text(USER_MODULE + textwrap.dedent(f'''
        if __name__ == "__main__":
            spec = {{"name": "script", "base": {{"rounds": 2, "partition.num_clients": 4, "clients_per_round": 2,
                     "local_epochs": 1, "model.hidden": [16], "final_personalization": False}},
                    "methods": ["shrink", "fedavg"], "seeds": [0, 1]}}
            d = fedskew.sweep(spec, jobs=2, out={str(tmp_path / "sw")!r})
            rows = fedskew.load_results(d, frame=False)
            print("STATUS", sorted(r["status"] for r in rows))
    '''))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert "STATUS ['done', 'done', 'done', 'done']" in done.stdout


def test_register_method_refuses_what_cannot_work(user_methods):
    with pytest.raises(ValueError, match="'fedmr' is a built-in method"):
        fedskew.register_method(type("Mine", (fedskew.Method,), {}), name="fedmr")
    with pytest.raises(TypeError, match="needs a subclass of fedskew.Method"):
        fedskew.register_method(object)
    with pytest.raises(ValueError, match="method name 'a b' is not allowed"):
        fedskew.register_method(type("Mine", (fedskew.Method,), {}), name="a b")

    def cell():  # a notebook cell: run again, it defines its class again, in the same place
        @fedskew.register_method(name="mine")
        class Mine(fedskew.Method):
            pass
        return Mine

    first = cell()
    assert fedskew.methods()["mine"] is first and first.name == "mine"
    again = cell()  # the cell run again replaces its method
    assert fedskew.methods()["mine"] is again and again is not first
    # another class, from another place, under the same name: refused, naming both (issue 54)
    with pytest.raises(ValueError, match=r"method name 'mine' is registered twice: by test_api\..*cell.<locals>.Mine "
                                         r"and by test_api.Other"):
        fedskew.register_method(type("Other", (fedskew.Method,), {}), name="mine")
    assert METHODS["fedprox"].name == "fedprox"
    fedskew.register_method(METHODS["fedprox"], name="prox_alias")  # a built-in class under a second name
    assert METHODS["fedprox"].name == "fedprox" and fedskew.methods()["prox_alias"] is METHODS["fedprox"]


# ---------------------------------------------------------------------------------------------
# load_results


@pytest.fixture(scope="module")
def small_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    spec = {"name": "t", "base": {"rounds": 2, "partition.num_clients": 4, "clients_per_round": 2,
                                  "local_epochs": 1, "model.hidden": [16]},
            "methods": ["fedavg", {"name": "fedprox", "options": {"mu": [0.01, 0.1]}}, {"name": "scaffold",
                                                                                        "options": {"bad": 1}}],
            "seeds": [0, 1]}
    with pytest.raises(ConfigError, match="method.bad is not an option of scaffold"):
        fedskew.sweep(spec, jobs=1, out=out)  # planned and validated before anything runs
    spec["methods"] = spec["methods"][:2]
    return fedskew.sweep(spec, jobs=1, out=out)


def test_load_results_rows_and_rounds(small_sweep):
    rows = fedskew.load_results(small_sweep, frame=False)
    assert len(rows) == 6 and {r["status"] for r in rows} == {"done"}
    by = {(r["label"], r.get("option/mu"), r["seed"]): r for r in rows}
    assert set(by) == {("fedavg", None, 0), ("fedavg", None, 1), ("fedprox", 0.01, 0), ("fedprox", 0.01, 1),
                       ("fedprox", 0.1, 0), ("fedprox", 0.1, 1)}
    for r in rows:
        summary = json.loads((Path(r["run_dir"]) / "summary.json").read_text())
        assert r["global/test_acc_mean_last10"] == summary["global/test_acc_mean_last10"]
        assert r["dataset"] == "digits" and r["rounds"] == 2
    # the selected grid point of fedprox: the best mean over seeds on the validation hold-out (the default)
    means = {mu: (by[("fedprox", mu, 0)]["global/val_acc_mean_last10"] +
                  by[("fedprox", mu, 1)]["global/val_acc_mean_last10"]) / 2 for mu in (0.01, 0.1)}
    best = max(means, key=means.get)
    assert all(r["selected"] == (r.get("option/mu") in (None, best)) for r in rows)
    per_round = fedskew.load_results(small_sweep, rounds=True, frame=False)
    assert len(per_round) == 6 * 2 and sorted({r["round"] for r in per_round}) == [0, 1]
    first = next(r for r in per_round if r["run_id"] == rows[0]["run_id"] and r["round"] == 1)
    assert first["global/test_acc"] == json.loads(
        (Path(rows[0]["run_dir"]) / "metrics.jsonl").read_text().splitlines()[1])["global/test_acc"]


def test_load_results_as_a_dataframe(small_sweep):
    pd = pytest.importorskip("pandas")  # in the test extra
    df = fedskew.load_results(small_sweep)
    assert isinstance(df, pd.DataFrame) and len(df) == 6
    assert df.groupby("label")["global/test_acc"].count().to_dict() == {"fedavg": 2, "fedprox": 4}
    rows = fedskew.load_results(small_sweep, frame=False)
    assert list(df.columns) == list(dict.fromkeys(k for r in rows for k in r))
    assert df["global/test_acc"].tolist() == [r["global/test_acc"] for r in rows]


def test_load_results_and_report_refuse_a_folder_that_is_not_a_sweep(tmp_path):
    with pytest.raises(ConfigError, match="is not a sweep folder"):
        fedskew.load_results(tmp_path)
    with pytest.raises(ConfigError, match="is not a sweep folder"):
        fedskew.report(tmp_path)
    # a bench folder: its parts are the sweeps, and the sentence names them (issue 54)
    import sqlite3

    (tmp_path / "map").mkdir()
    sqlite3.connect(tmp_path / "map" / "results.sqlite").close()
    with pytest.raises(ConfigError, match=r"is a bench folder, whose parts are sweeps: report one of them \(.*map\)"):
        fedskew.report(tmp_path)


# ---------------------------------------------------------------------------------------------
# The package as documentation, and its layout


def test_import_fedskew_is_light_and_help_is_the_guide():
    code = ("import sys, fedskew, pydoc; text = pydoc.render_doc(fedskew, renderer=pydoc.plaintext); "
            "print('torch' in sys.modules, len(text))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "False"  # no torch until something runs
    text = pydoc.render_doc(fedskew, renderer=pydoc.plaintext)
    for name in ("run", "resume", "sweep", "report", "load_results", "methods", "register_method", "load_config"):
        assert f"{name}(" in text, name
        assert getattr(fedskew, name).__doc__ or name == "methods"
    assert fedskew.Method is METHODS["fedavg"] and fedskew.RunResult.__doc__
    assert all(getattr(fedskew, name) is not None for name in fedskew.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        _ = fedskew.nothing


# Which top-level parts of the package each part may import: one way,
# cli -> experiments -> engine -> algorithms -> metrics -> models/data -> streams; flower -> engine.
ALLOWED = {
    "streams": set(),
    "data": {"streams"},
    "models": {"streams"},
    "metrics": {"models", "streams"},
    "algorithms": {"metrics", "models", "streams"},  # metrics: statistics a method and a diagnostic share
    # the method registry validates method options; the data and model sections read their keys
    # from the loaders' and builders' signatures (data and models never import config)
    # files, the one reader of what fedskew did not write, belongs to config's layer: its errors are
    # config errors, and config reads config files through it (imported inside functions)
    "config": {"algorithms", "data", "models", "files"},
    "files": {"config"},
    "engine": {"config", "files", "data", "models", "algorithms", "metrics", "streams"},
    "experiments": {"engine", "config", "files", "data", "algorithms", "streams"},
    "flower": {"engine", "config", "files", "algorithms", "models"},
    "cli": {"experiments", "flower", "engine", "config", "files", "data", "models", "algorithms", "streams"},
}


def package_imports(path: Path) -> set[str]:
    """The fedskew parts a module imports, at top level or inside functions (``from fedskew
    import __version__`` is free)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "fedskew" and [a.name for a in node.names] == ["__version__"]:
                continue
            names = [node.module]
        out |= {n.split(".")[1] for n in names if n.startswith("fedskew.")}
        out |= {"(root)" for n in names if n == "fedskew"}
    return out


def test_dependencies_point_one_way():
    problems = []
    for path in sorted((ROOT / "src" / "fedskew").rglob("*.py")):
        rel = path.relative_to(ROOT / "src" / "fedskew")
        part = rel.parts[0].removesuffix(".py")
        if part == "__init__":  # the public API imports everything, lazily
            continue
        for used in package_imports(path) - {part}:
            if used not in ALLOWED[part]:
                problems.append(f"fedskew/{rel} imports fedskew.{used}")
    assert not problems, problems
    assert package_imports(ROOT / "src/fedskew/flower/client.py") == set()  # the deployment ClientApp: torch-free


def test_run_prints_a_line_a_round_when_asked(tmp_path, capsys):
    seen = []
    fedskew.run(rounds=2, out_dir=str(tmp_path), progress=True, on_round=seen.append)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("round ")]
    assert [ln.split()[1] for ln in lines] == ["1/2", "2/2"] and len(seen) == 2
    fedskew.run(rounds=1, out_dir=str(tmp_path), progress=False)
    assert "round " not in capsys.readouterr().out


def test_two_unnamed_runs_of_one_second_get_two_folders(tmp_path, monkeypatch):
    """Without run_name a run's folder is named by the second it started; a second run of that
    second gets its own folder, not the first one's ("already holds a run")."""
    import time

    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20261208-000034")
    a = fedskew.run(rounds=1, out_dir=str(tmp_path), progress=False)
    b = fedskew.run(rounds=1, out_dir=str(tmp_path), progress=False)
    assert a.run_dir.name == "fedavg-digits-pcdd-s0-20261208-000034" and b.run_dir.name == a.run_dir.name + "-2"
