"""Issue 45: what a researcher's first day met, each as a test: your own method in the bench and the
Python API, sweeps that never run the caller's script again, and the probes' one-sentence errors
(resume only what fedskew wrote, checkpoints of another run refused, bounded options, bench flags,
the published-results registry checked before anything trains)."""

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import fedskew
from fedskew.config import ConfigError

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
TINY = {"rounds": 2, "partition.num_clients": 6, "clients_per_round": 3, "local_epochs": 1, "model.hidden": [16],
        "final_personalization": False}


def cli(*args, cwd, timeout=300):
    return subprocess.run([sys.executable, "-m", "fedskew.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=ENV, timeout=timeout)


def one_sentence(done, text):
    assert done.returncode == 2, (done.returncode, done.stderr[-1500:])
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert text in done.stderr, done.stderr


# ---------------------------------------------------------------------------------------------
# Python API


@pytest.mark.slow
def test_a_script_runs_once_whatever_its_workers_do(tmp_path):
    """README's snippet as a script run the way users ran it: a top-level run, then an unguarded
    sweep with two workers. The workers import fedskew and the methods' modules only, so the
    top-level run happens once (before: once more per worker) and the sweep is not refused."""
    script = tmp_path / "mine.py"
    script.write_text(textwrap.dedent(f"""
        import fedskew
        fedskew.run(out_dir="runs", run_name="top", **{TINY!r})
        spec = {{"name": "s", "base": {TINY!r}, "methods": ["fedavg"], "seeds": [0, 1, 2, 3]}}
        fedskew.sweep(spec, jobs=2, out="sw", progress=False)
        print("finished")
    """))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("finished") == 1
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["top"]  # no run made again by a worker
    rows = fedskew.load_results(tmp_path / "sw", frame=False)
    assert len(rows) == 4 and {r["status"] for r in rows} == {"done"}
    # the same script from stdin (no file, no .py suffix): the workers need nothing of it either
    piped = subprocess.run([sys.executable, "-"], input=script.read_text().replace('"sw"', '"sw2"').replace(
        'run_name="top"', 'run_name="top2"'), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert piped.returncode == 0, piped.stderr[-2000:]
    assert {r["status"] for r in fedskew.load_results(tmp_path / "sw2", frame=False)} == {"done"}


def test_a_guard_with_more_conditions_is_a_guard(tmp_path):
    from fedskew.experiments.pool import unguarded_script_line

    script = tmp_path / "g.py"
    script.write_text("import sys\nimport fedskew\nif __name__ == '__main__' and len(sys.argv) > 0:\n"
                      "    frame = sys._getframe(0)\n")
    import ast

    tree = ast.parse(script.read_text())
    node = tree.body[2]
    assert isinstance(node.test, ast.BoolOp)  # `if __name__ == "__main__" and ...:` is what the check reads
    assert unguarded_script_line(None) is None


def test_sweep_takes_a_sweep_spec_and_progress_follows_the_terminal(tmp_path, monkeypatch, capsys):
    from fedskew.experiments.sweep import load_spec

    spec = load_spec({"name": "obj", "base": TINY, "methods": ["fedavg"], "seeds": [0]})
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a person at a terminal
    folder = fedskew.sweep(spec, jobs=1, out=tmp_path / "sw")
    assert {r["status"] for r in fedskew.load_results(folder, frame=False)} == {"done"}
    assert "fedskew sweep: 1/1 runs (0 running, 0 failed)" in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)  # a log: silent unless asked
    fedskew.sweep(spec, jobs=1, out=tmp_path / "sw")
    assert "fedskew sweep:" not in capsys.readouterr().err


@pytest.mark.slow
def test_your_own_method_in_the_bench_from_python_and_the_cli(tmp_path, monkeypatch):
    """A method registered in a module of the user's joins the label-skew leaderboard under the
    same budget, from fedskew.bench and from `fedskew bench --import`."""
    (tmp_path / "my_methods.py").write_text(textwrap.dedent("""
        import fedskew
        from fedskew.algorithms.base import FedAvgOptions

        @fedskew.register_method
        class Doubled(fedskew.Method):
            name = "doubled"
            class Options(FedAvgOptions):
                search = {"scale": [1.0, 2.0]}
                scale: float = 2.0
            def local_loss(self, fwd, params, x, y, payload, client_state):
                loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
                return loss * self.opt.scale, aux
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    from fedskew.algorithms import METHODS

    monkeypatch.setitem(METHODS, "doubled", fedskew.Method)  # (removed again after the test)
    __import__("my_methods")
    monkeypatch.setitem(sys.modules, "my_methods", sys.modules["my_methods"])
    folder = fedskew.bench("label-skew", scale="smoke", methods=["fedavg", "doubled"], settings=["#C=2"], jobs=1,
                           out=tmp_path / "api", progress=False)
    board = (folder / "leaderboard.md").read_text()
    assert "| doubled |" in board and "Summary (generated)" in board
    # the rebuild line is the call that made it, with the user's module (issue 54)
    assert (
        f"Rebuild: `import my_methods; fedskew.bench('label-skew', scale='smoke', methods=['fedavg', 'doubled'], "
        f"settings=['#C=2'], out={str(tmp_path / 'api')!r})` (`fedskew bench label-skew --scale smoke --out "
    ) in board
    rows = fedskew.load_results(folder / "label-skew-digits", frame=False)
    assert {r["partition"] for r in rows} == {"#C=2"} and {r["label"] for r in rows} == {"fedavg", "doubled"}
    assert sum(r["label"] == "doubled" for r in rows) == 2  # the smoke budget: two trials, like every method
    done = cli("bench", "label-skew", "--scale", "smoke", "--import", "my_methods.py", "--methods", "fedavg,doubled",
               "--settings", "#C=2", "--jobs", "2", "--out", "cli", cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--import my_methods.py" in (tmp_path / "cli" / "leaderboard.md").read_text()  # the rebuild command
    # issue 54, item 17: the user's method changed, so its runs train again; FedAvg's are kept, and
    # the old runs are superseded (never averaged with the new ones)
    def cli_rows():
        return fedskew.load_results(tmp_path / "cli" / "label-skew-digits", frame=False)
    before = {r["run_id"] for r in cli_rows()}
    source = (tmp_path / "my_methods.py").read_text()
    (tmp_path / "my_methods.py").write_text(source.replace("scale: float = 2.0", "scale: float = 2.0  # changed"))
    again = cli("bench", "label-skew", "--scale", "smoke", "--import", "my_methods.py", "--methods", "fedavg,doubled",
                "--settings", "#C=2", "--jobs", "2", "--out", "cli", cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    rows = cli_rows()
    status = {(r["label"], r["run_id"] in before): r["status"] for r in rows}
    assert status == {("fedavg", True): "done", ("doubled", True): "superseded", ("doubled", False): "done"}, status
    assert sum(r["label"] == "doubled" and r["status"] == "done" for r in rows) == 2
    # a board from runs of more than one commit, or of a tree with uncommitted changes, says so; --strict refuses it
    import sqlite3

    db = sqlite3.connect(tmp_path / "cli" / "label-skew-digits" / "results.sqlite")
    run_id, env = db.execute("SELECT run_id, environment FROM runs WHERE status='done' LIMIT 1").fetchone()
    db.execute("UPDATE runs SET environment=? WHERE run_id=?",
               (json.dumps({**json.loads(env), "git_commit": "0123456789ab+dirty"}), run_id))
    db.commit()
    db.close()
    report = ["bench", "label-skew", "--scale", "smoke", "--import", "my_methods.py", "--out", "cli", "--report"]
    assert cli(*report, cwd=tmp_path).returncode == 0
    board = (tmp_path / "cli" / "leaderboard.md").read_text()
    assert "This board is not from one clean commit: its runs come from 2 code versions" in board
    assert "of them from a working tree with uncommitted changes" in board
    one_sentence(cli(*report, "--strict", cwd=tmp_path), "bench --strict: the board of 'cli' is not built")
    missing = cli("bench", "label-skew", "--scale", "smoke", "--methods", "fedavg,doubled", cwd=tmp_path)
    one_sentence(missing, "a method of your own: --import MODULE")


# ---------------------------------------------------------------------------------------------
# Nothing lost, no traceback


def test_resume_refuses_a_folder_that_no_run_wrote(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.yaml").write_text("method: fedavg\nrounds: 2\n")
    (d / "summary.json").write_text('{"mine": 1}')
    one_sentence(cli("resume", "d", cwd=tmp_path), "'d' holds a config.yaml that no fedskew run wrote")
    assert json.loads((d / "summary.json").read_text()) == {"mine": 1}  # untouched
    assert sorted(p.name for p in d.iterdir()) == ["config.yaml", "summary.json"]


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
@pytest.mark.parametrize("command", [["resume", "d"], ["run", "--resume", "d"]])
@pytest.mark.parametrize("with_environment", [True, False])
def test_resume_refuses_a_folder_holding_a_config_copied_from_a_real_run(tmp_path, command, with_environment):
    """Issue 54, item 12: a config.yaml copied from a real run (fedskew's record, with or without
    its environment) does not make a folder a run; resume finds no run.json and no checkpoint of that
    config, says so, and leaves the user's files as they were."""
    import yaml

    fedskew.run(run_name="real", **{**TINY, "out_dir": str(tmp_path)})
    record = yaml.safe_load((tmp_path / "real" / "config.yaml").read_text())
    if not with_environment:
        record.pop("environment")
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump(record))
    (d / "summary.json").write_text('{"mine": 1}')
    out = cli(*command, cwd=tmp_path)
    one_sentence(out, "'d' holds a config.yaml" if with_environment else "no fedskew run wrote")
    assert json.loads((d / "summary.json").read_text()) == {"mine": 1}  # untouched
    assert sorted(p.name for p in d.iterdir()) == ["config.yaml", "summary.json"]
    if not (with_environment and command[0] == "resume"):
        return  # (what follows is the same in every case: once is enough)
    # the real run resumes (read back: it finished), a copy of its whole folder too
    done = cli("resume", "real", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-1500:]
    shutil.copytree(tmp_path / "real", tmp_path / "copy")
    done = cli("resume", "copy", "rounds=3", cwd=tmp_path)  # (it failed twice under a paused, loaded suite:
    assert done.returncode == 0, done.stderr[-1500:]       # its stderr tells why, should it fail again)


def test_a_checkpoint_of_another_run_is_never_taken(tmp_path):
    small = {**TINY, "out_dir": str(tmp_path)}
    fedskew.run(method="scaffold", run_name="sc", **small)
    fedskew.run(method="fedavg", run_name="fa", **{**small, "rounds": 3})
    (tmp_path / "fa" / "checkpoint.pt").write_bytes((tmp_path / "sc" / "checkpoint.pt").read_bytes())
    (tmp_path / "fa" / "checkpoint.prev.pt").unlink(missing_ok=True)
    (tmp_path / "fa" / "summary.json").unlink()
    before = {p.name: p.read_bytes() for p in (tmp_path / "fa").iterdir() if p.is_file()}
    one_sentence(cli("resume", "fa", cwd=tmp_path), "checkpoint.pt: it belongs to another run")
    assert {p.name: p.read_bytes() for p in (tmp_path / "fa").iterdir() if p.is_file()} == before


@pytest.mark.parametrize("args, text", [
    (["method=pfedhn", "method.hidden=1000000"], "method.hidden = 1000000 is not allowed"),
    (["method=pfedhn", "method.hidden=10000"], "method pfedhn's hypernetwork (method.hidden = 10000"),
    (["method=pfedhn", "method.n_hidden=1000"], "method.n_hidden = 1000 is not allowed"),
    (["method=pfedhn", "method.embed_dim=100000"], "method.embed_dim = 100000 is not allowed"),
    (["method=fedfed", "method.vae_width=1000000"], "method.vae_width = 1000000 is not allowed"),
    (["method=fedfed", "method.vae_width=4000"], "method fedfed's VAE (method.vae_width = 4000)"),
    (["method=fedfed", "method.vae_epochs=1000000000"], "method.vae_epochs = 1000000000 is not allowed"),
])
def test_sizes_are_bounded_before_anything_is_allocated(tmp_path, args, text):
    one_sentence(cli("run", *args, "rounds=1", cwd=tmp_path, timeout=120), text)


@pytest.mark.parametrize("args, text", [
    (["compile=sometimes"], "config key 'compile' = 'sometimes' is not allowed: Input should be 'off', 'on' or 'auto'"),
    (["compile=on", "executor=sequential"],
     "compile = on compiles the vectorized executor's stacked step; set executor = vectorized"),
])
def test_compile_takes_off_on_or_auto_and_on_needs_the_vectorised_executor(tmp_path, args, text):
    one_sentence(cli("run", *args, "rounds=1", cwd=tmp_path, timeout=120), text)


@pytest.mark.parametrize("args, text", [
    (["channels_last=nhwc"], "config key 'channels_last' = 'nhwc' is not allowed: Input should be 'off', 'on' or "
                             "'auto'"),
    (["channels_last=on", "executor=vectorized"],
     "channels_last = on lays out the sequential executor's model and batches; set executor = sequential"),
])
def test_channels_last_takes_off_on_or_auto_and_on_needs_the_sequential_executor(tmp_path, args, text):
    one_sentence(cli("run", *args, "rounds=1", cwd=tmp_path, timeout=120), text)


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_bench_flags_are_checked_before_anything_runs(tmp_path):
    one_sentence(cli("bench", "label-skew", cwd=tmp_path), "bench label-skew needs --scale smoke, lite or paper")
    one_sentence(cli("bench", "label-skew", "--scale", "smoke", "--seeds", ",", cwd=tmp_path),
                 "bench --seeds ',' names nothing")
    one_sentence(cli("bench", "label-skew", "--scale", "smoke", "--settings", "#C=9", cwd=tmp_path),
                 "bench --settings names '#C=9', which is not a setting of suite 'label-skew' (did you mean '#C=2'?)")
    (tmp_path / "afile").write_text("x")
    one_sentence(cli("bench", "label-skew", "--scale", "smoke", "--out", "afile/sub", "--report", cwd=tmp_path),
                 "'afile' is a file, not a folder")
    one_sentence(cli("sweep", "--out", "x" * 300, cwd=tmp_path), "has a folder name 300 bytes long")
    assert not (tmp_path / "runs").exists()
    # a folder that holds one suite at one scale is not rebuilt as another's
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "bench.yaml").write_text(yaml.safe_dump({"suite": "niid-bench", "scale": "lite"}))
    one_sentence(cli("bench", "label-skew", "--scale", "smoke", "--out", "suite", "--report", cwd=tmp_path),
                 "folder 'suite' holds bench suite 'niid-bench' at scale 'lite', not 'label-skew' at 'smoke'")


@pytest.mark.parametrize("entry, text", [
    ({"value": math.nan}, "has value nan"),
    ({"method": "fedavgg"}, "names method 'fedavgg', which is not registered (did you mean 'fedavg'?)"),
    ({"value": "high"}, "key 'entries.0.value' is not valid"),
])
def test_the_registry_is_checked_key_by_key(tmp_path, entry, text):
    from fedskew.experiments.published import load

    good = yaml.safe_load((Path(fedskew.__file__).parent / "experiments/published/map_table1.yaml").read_text())
    good["entries"] = [{**good["entries"][0], **entry}]
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(good))
    with pytest.raises(ConfigError, match="published-results file 't.yaml'") as err:
        load(tmp_path)
    assert text in str(err.value)
    good["entries"] = [good["entries"][0]] * 2 if entry.get("value") is math.nan else good["entries"][:1] * 2
    good["entries"] = [{**e, "value": 1.0, "method": "fedavg"} for e in good["entries"]]
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(good))
    with pytest.raises(ConfigError, match="appears twice in the file"):
        load(tmp_path)


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_a_run_of_your_own_method_resumes_with_import_and_never_imports_by_itself(tmp_path):
    """A run of the user's method records the file it came from; `fedskew resume DIR` without
    --import imports nothing (code runs only from what the command line names) and says, in one
    sentence, the --import that continues it; the interrupted run's hint names --import too; with
    --import the run continues."""
    (tmp_path / "mine.py").write_text(textwrap.dedent("""
        import fedskew

        @fedskew.register_method
        class Halved(fedskew.Method):
            name = "halved"
            def local_loss(self, fwd, params, x, y, payload, client_state):
                loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
                return loss * 0.5, aux
    """))
    tiny = [f"{k}={json.dumps(v)}" for k, v in TINY.items()]
    done = cli("run", "--import", "mine.py", "method=halved", "run_name=h", *tiny, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "runs" / "h" / "run.json").read_text())
    source = (tmp_path / "mine.py").resolve()
    assert record["method_source"] == {"module": "mine", "file": str(source),
                                       "sha256": hashlib.sha256(source.read_bytes()).hexdigest()}
    other = tmp_path / "elsewhere"
    other.mkdir()
    # no --import, another folder: nothing is imported, the sentence names what to pass
    one_sentence(cli("resume", str(tmp_path / "runs" / "h"), "rounds=3", cwd=other),
                 f"`fedskew resume --import {source} {tmp_path / 'runs' / 'h'}` continues it")
    assert json.loads((tmp_path / "runs" / "h" / "summary.json").read_text())["rounds"] == 2
    again = cli("resume", "--import", str(tmp_path / "mine.py"), str(tmp_path / "runs" / "h"), "rounds=3", cwd=other)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((tmp_path / "runs" / "h" / "summary.json").read_text())["rounds"] == 3


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_a_folder_from_elsewhere_runs_no_code_and_nothing_of_the_user_s_is_replaced(tmp_path):
    """A run folder from a colleague or a download: its run.json names a module that would write a
    marker; with config.yaml and run.json copied beside the user's own summary.json, metrics.jsonl
    and notes, `fedskew resume` and `fedskew run --resume` refuse in one sentence before importing
    anything, and no file changes. A run.json that is a folder is one sentence too."""
    (tmp_path / "mine.py").write_text(textwrap.dedent(f"""
        import pathlib
        pathlib.Path({str(tmp_path / "MARKER")!r}).write_text("ran")
        import fedskew

        @fedskew.register_method
        class Halved(fedskew.Method):
            name = "halved"
    """))
    tiny = [f"{k}={json.dumps(v)}" for k, v in TINY.items()]
    assert cli("run", "--import", "mine.py", "method=halved", "run_name=h", *tiny, cwd=tmp_path).returncode == 0
    (tmp_path / "MARKER").unlink()
    user = tmp_path / "mine-notes"
    user.mkdir()
    for name in ("config.yaml", "run.json"):
        shutil.copy(tmp_path / "runs" / "h" / name, user / name)
    (user / "summary.json").write_text('{"mine": 1}')
    (user / "metrics.jsonl").write_text('{"round": 0, "mine": true}\n')
    (user / "notes.txt").write_text("my notes")
    before = {p.name: p.read_bytes() for p in user.iterdir()}
    for command in (["resume", str(user)], ["run", "--resume", str(user)]):
        one_sentence(cli(*command, cwd=tmp_path), "nothing shows that a fedskew run wrote this folder")
        assert not (tmp_path / "MARKER").exists()  # the recorded module was never imported
        assert {p.name: p.read_bytes() for p in user.iterdir()} == before
    (user / "run.json").unlink()
    (user / "run.json").mkdir()
    one_sentence(cli("resume", str(user), cwd=tmp_path), "run.json' is not a file")
    assert not (user / "run.json.tmp").exists() and not (tmp_path / "MARKER").exists()
    # a source file inside the run folder itself is never imported, even with its digest
    run = tmp_path / "runs" / "h"
    shutil.copy(tmp_path / "mine.py", run / "mine.py")
    record = json.loads((run / "run.json").read_text())
    record["method_source"]["file"] = str((run / "mine.py").resolve())
    (run / "run.json").write_text(json.dumps(record))
    one_sentence(cli("resume", str(run), "rounds=3", cwd=tmp_path), "a run folder never imports code by itself")
    assert not (tmp_path / "MARKER").exists()
    # nor one beside it, relative or absolute, whose digest run.json records (a bundle's helper.py)
    for named in (str(tmp_path / "mine.py"), "mine.py"):
        record["method_source"] = {"module": "mine", "file": named,
                                   "sha256": hashlib.sha256((tmp_path / "mine.py").read_bytes()).hexdigest()}
        (run / "run.json").write_text(json.dumps(record))
        one_sentence(cli("resume", "runs/h", "rounds=3", cwd=tmp_path), "a run folder never imports code by itself")
        assert not (tmp_path / "MARKER").exists()
