"""The first hour and the daily loop, through the real command line: progress, reports that refuse
to mislead, one-sentence errors, interruptions, multirun, --print-config, `fedskew methods`, and
the environment every run records."""

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import fedskew
from fedskew.algorithms import METHODS, family_of
from fedskew.cli import split_multirun
from fedskew.config import ConfigError, load_config
from fedskew.experiments.report import build_table

TINY = ["partition.num_clients=6", "clients_per_round=3", "local_epochs=1", "model.hidden=[16]",
        "final_personalization=false"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}


def cli(*args, cwd, timeout=300, env=ENV):
    return subprocess.run([sys.executable, "-m", "fedskew.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def sweep_with_a_failure(tmp_path_factory):
    """fedavg and fedprox, 2 seeds; every fedprox run fails (lr so large the loss diverges)."""
    folder = tmp_path_factory.mktemp("ux") / "sw"
    spec = {"name": "ux", "base": {"rounds": 3, "partition.num_clients": 6, "clients_per_round": 3,
                                   "local_epochs": 1, "model.hidden": [16]},
            "methods": ["fedavg", {"name": "fedprox", "config": {"lr": 1.0e6}}], "seeds": [0, 1]}
    with pytest.warns(UserWarning, match="2 run"):
        fedskew.sweep(spec, jobs=1, out=folder)
    return folder


# ---------------------------------------------------------------------------------------------
# Reports that cannot mislead


def test_report_refuses_an_unknown_metric_or_baseline(sweep_with_a_failure, tmp_path):
    done = cli("report", sweep_with_a_failure, "--metric", "global/test_accc", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "report metric 'global/test_accc' is in no finished run's summary (did you mean 'global/test_acc'?)" \
        in done.stderr
    done = cli("report", sweep_with_a_failure, "--baseline", "fedavgg", cwd=tmp_path)
    assert done.returncode == 2
    assert "report baseline 'fedavgg' is not a method of this sweep (did you mean 'fedavg'?)" in done.stderr


def test_report_labels_failed_runs_and_titles_from_the_metric(sweep_with_a_failure, tmp_path):
    assert cli("report", sweep_with_a_failure, "--metric", "train/loss", "--out", tmp_path / "r", cwd=tmp_path
               ).returncode == 0
    md = (tmp_path / "r" / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| default |"))
    assert "failed (2)" in row  # not "none"
    assert "## train/loss: `train/loss`" in md and "Global accuracy" not in md.split("## ")[1]
    assert "(%)" not in md.split("## ")[1].splitlines()[0]  # a loss is not a percentage
    assert cli("report", sweep_with_a_failure, cwd=tmp_path).returncode == 0
    md = (sweep_with_a_failure / "report" / "report.md").read_text()
    assert "## Global accuracy, mean of the last 10 evaluations (%)" in md
    assert "## Global accuracy, final round (%): `global/test_acc`" in md  # beside the mean over rounds
    assert "Rounds to reach 95% of fedavg's best accuracy" in md


def test_bold_marks_the_top_group_and_nothing_below_three_seeds():
    cells = {("P", "a"): [0.80, 0.84, 0.82], ("P", "b"): [0.81, 0.82, 0.815], ("P", "c"): [0.50, 0.52, 0.51],
             ("Q", "a"): [0.9, 0.9, 0.9], ("Q", "b"): [0.7, 0.7, 0.7]}
    t = build_table(cells, ["P", "Q"], ["a", "b", "c"], None)
    # a 0.82 is best; b 0.815 a tie by the paired test over the three seeds; c is significantly worse
    assert t["P"]["a"]["top"] and t["P"]["b"]["top"] and not t["P"]["c"]["top"]
    assert t["P"]["a"]["best"] and not t["P"]["b"]["best"]
    assert t["Q"]["a"]["top"] and not t["Q"]["b"]["top"]  # no spread: only the best
    two = build_table({("P", "a"): [0.8879, 0.8879], ("P", "b"): [0.6522, 0.6621]}, ["P"], ["a", "b"], None)
    assert not two["P"]["a"]["top"] and not two["P"]["b"]["top"]  # two seeds: nothing bold (issue 54)


# ---------------------------------------------------------------------------------------------
# Errors and interruptions


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_bad_input_is_one_sentence(tmp_path):
    (tmp_path / "afile").write_text("x")
    done = cli("run", "out_dir=afile", "rounds=1", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == ("fedskew: error: out_dir 'afile' cannot hold a run: 'afile' is a file, not a "
                                   "folder; choose another out_dir.")
    (tmp_path / "bad.yaml").write_text("rounds: 3\nmodel: {name: mlp\nlr: 0.1\n")
    done = cli("run", "bad.yaml", cwd=tmp_path)
    assert done.returncode == 2 and re.search(r"is not valid YAML \(line \d+, column \d+: ", done.stderr)
    with pytest.raises(ConfigError, match=r"config key 'rouns' is not known \(did you mean 'rounds'\?\)"):
        load_config(None, ["rouns=3"])
    with pytest.raises(ConfigError, match=r"config key 'partition.alpah' is not known \(did you mean 'alpha'\?\)"):
        load_config(None, ["partition.alpah=0.1"])
    with pytest.raises(ConfigError, match=r"method.mu11 is not an option of fedmr \(did you mean 'mu1'\?\)"):
        load_config(None, ["method=fedmr", "method.mu11=1"])
    with pytest.raises(ConfigError, match=r"method.name 'fedmrr' is not known \(did you mean 'fedmr'\?\)"):
        load_config(None, ["method=fedmrr"])
    with pytest.raises(ConfigError, match=r"sweep key 'seed' is not known \(did you mean 'seeds'\?\)"):
        fedskew.sweep({"methods": ["fedavg"], "seed": [0]}, out=tmp_path / "s")


def test_a_sweep_checks_its_data_once_before_planning(tmp_path):
    spec = {"name": "nodata", "base": {"dataset": {"name": "mnist", "root": str(tmp_path / "none"),
                                                   "download": False}},
            "methods": ["fedavg", "fedprox", "scaffold"], "seeds": [0, 1, 2]}
    (tmp_path / "nodata.yaml").write_text(yaml.safe_dump(spec))
    done = cli("sweep", "nodata.yaml", "--out", "out", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("fedskew: error: dataset 'mnist' was not found") == 1
    assert not (tmp_path / "out").exists()  # nothing planned, no 9 failed runs


def wait_for(path: Path, lines: int, proc, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.is_file() and len(path.read_text().splitlines()) >= lines:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{path} never reached {lines} lines")


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_ctrl_c_stops_a_run_with_the_resume_hint(tmp_path):
    # 60 rounds: the signal, sent once round 0 is recorded, lands while the run still has most of its
    # rounds ahead however loaded the machine (with 6, a busy test process could send it after the end)
    args = ["run", "rounds=60", *TINY, "out_dir=.", "run_name=r"]
    proc = subprocess.Popen([sys.executable, "-m", "fedskew.cli", *args], cwd=tmp_path, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(tmp_path / "r" / "metrics.jsonl", 1, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    # (exit 1 once, 2026-11-28)
    assert proc.returncode == 130 and "Traceback" not in err, (proc.returncode, err[-2000:])
    assert "fedskew: interrupted; the run directory keeps the last checkpoint: `fedskew resume r` continues it." in err
    done = cli("resume", "r", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["round"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()] == \
        list(range(60))


# A script that runs `fedskew run` with a Ctrl-C sent from inside the run at one of three places: `held`, while
# the run writes its record and partition (its first checkpoint not yet written); `converted`, before the first
# round, where the KeyboardInterrupt is turned into another exception as a C extension's import turns it
# (matplotlib's ft2font: "ImportError: initialization failed"; found by signalling runs at random moments, which
# also crashed the interpreter's shutdown: exit -6); `swallowed`, in the first round inside a __del__, where
# Python prints "Exception ignored" and drops the KeyboardInterrupt (found the same way: the run went on, exit 0)
SIGNAL_INSIDE = """
import os, signal, sys, time
import fedskew.cli
from fedskew.engine import rundir, runner
where = sys.argv[1]
def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(200):  # the handler runs at the next bytecode
        time.sleep(0.01)
if where == "starting":
    warnings = fedskew.cli._one_line_warnings
    def patched():
        ctrl_c()
        warnings()
    fedskew.cli._one_line_warnings = patched
elif where == "held":
    write_partition = rundir.RunDir.write_partition
    def patched(self, *a, **k):
        ctrl_c()
        return write_partition(self, *a, **k)
    rundir.RunDir.write_partition = patched
elif where == "swallowed":
    class Collected:
        def __del__(self):
            ctrl_c()
    one_round = runner.Experiment._round
    def patched(self, t, *a, **k):
        if t == 0:
            Collected()  # (freed at once: its __del__ runs here)
        return one_round(self, t, *a, **k)
    runner.Experiment._round = patched
else:
    rounds = runner.Experiment._rounds
    def patched(self, *a, **k):
        try:
            ctrl_c()
        except KeyboardInterrupt:
            raise ImportError("initialization failed") from None
        return rounds(self, *a, **k)
    runner.Experiment._rounds = patched
sys.argv = ["fedskew", "run", "rounds=3", *sys.argv[2:]]
fedskew.cli.entry()
"""


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
@pytest.mark.parametrize("where", ["starting", "held", "converted", "swallowed"])
def test_a_ctrl_c_anywhere_in_a_run_is_the_interruption_and_the_run_resumes(tmp_path, where):
    """``starting``: a Ctrl-C while the command imports its libraries, before anything is written (a
    sweep's Ctrl-C in its first seconds ended in a KeyboardInterrupt traceback); ``held``: a Ctrl-C while a
    run writes the files that make its folder its own waits until its first checkpoint is written (else the
    folder could not show a resume that it is the run's); ``converted``: a Ctrl-C that reaches the command
    as another exception is still the interruption; ``swallowed``: one whose KeyboardInterrupt Python
    dropped stops the run after its round. Each way: exit 130, the interruption's sentence (with the resume
    command once a run exists), no traceback, and ``fedskew resume`` finishes the run."""
    (tmp_path / "signal_inside.py").write_text(SIGNAL_INSIDE)
    done = subprocess.run([sys.executable, "signal_inside.py", where, *TINY, "out_dir=.", "run_name=r"], cwd=tmp_path,
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 130 and "Traceback" not in done.stderr, (done.returncode, done.stderr[-2000:])
    if where == "starting":
        assert done.stderr.strip() == "fedskew: interrupted." and not (tmp_path / "r").exists()
        return
    assert "fedskew: interrupted; the run directory keeps the last checkpoint: `fedskew resume r` continues it." in \
        done.stderr
    assert (tmp_path / "r" / "checkpoint.pt").is_file() and not (tmp_path / "r" / "summary.json").exists()
    resumed = cli("resume", "r", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [json.loads(line)["round"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()] == \
        [0, 1, 2]


def test_ctrl_c_inside_a_checkpoint_write_is_the_interruption_not_a_traceback(tmp_path, monkeypatch):
    """A Ctrl-C that lands inside torch.save leaves its zip writer raising RuntimeError ("unexpected
    pos") on the way out (found under load: exit 1 with a traceback); the checkpoint write answers
    with the KeyboardInterrupt, the half-written file is removed and the previous checkpoint kept."""
    import torch

    from fedskew.engine.durable import atomic_save

    atomic_save({"a": torch.zeros(3)}, tmp_path / "c.pt")
    real_save = torch.save

    class Interrupted:  # the signal arrives after the first 1,000 bytes
        def __init__(self, fh):
            self.fh, self.written = fh, 0

        def write(self, data) -> int:
            if self.written + len(data) > 1000:
                raise KeyboardInterrupt
            self.written += len(data)
            return self.fh.write(data)

        def flush(self) -> None:
            self.fh.flush()

    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: real_save(obj, Interrupted(f), *a, **k))
    with pytest.raises(KeyboardInterrupt):
        atomic_save({"a": torch.ones(10_000)}, tmp_path / "c.pt")
    monkeypatch.undo()
    assert torch.equal(torch.load(tmp_path / "c.pt")["a"], torch.zeros(3)) and not (tmp_path / "c.pt.tmp").exists()


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_ctrl_c_stops_a_parallel_sweep_and_the_same_command_finishes_it(tmp_path):
    spec = {"name": "int", "base": {"rounds": 4, "partition.num_clients": 6, "clients_per_round": 3,
                                    "local_epochs": 1, "model.hidden": [16], "final_personalization": False},
            "methods": ["fedavg", "fedprox"], "seeds": [0, 1, 2]}
    (tmp_path / "int.yaml").write_text(yaml.safe_dump(spec))
    cmd = [sys.executable, "-m", "fedskew.cli", "sweep", "int.yaml", "--out", "sw", "--jobs", "2", "--no-report"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not list((tmp_path / "sw" / "runs").glob("*/metrics.jsonl")):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "`fedskew sweep sw/sweep.yaml --out sw --jobs 2` continues the sweep" in err
    done = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert {r["status"] for r in fedskew.load_results(tmp_path / "sw", frame=False)} == {"done"}


# ---------------------------------------------------------------------------------------------
# Progress


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_sweep_progress_lines_count_and_fit(tmp_path):
    spec = {"name": "prog", "base": {"rounds": 2, "partition.num_clients": 6, "clients_per_round": 3,
                                     "local_epochs": 1, "model.hidden": [16]},
            "methods": ["fedavg", {"name": "fedprox", "options": {"mu": [0.01, 0.1]}}], "seeds": [0, 1]}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(spec))
    done = cli("sweep", "p.yaml", "--out", "sw", "--jobs", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    counted = [line for line in lines if line.startswith("[")]
    assert [int(re.match(r"\[(\d+)/6\]", line).group(1)) for line in counted] == [1, 2, 3, 4, 5, 6]
    assert all(len(line) <= 120 for line in counted)
    assert "fedprox mu=0.1 default s1: global" in done.stdout
    assert "progress: 6/6 runs (0 running, 0 failed), 12/12 rounds; " in done.stdout  # a plain line for logs
    # the final table is a terminal table titled with the metric and its unit
    assert "Global accuracy, mean of the last 10 evaluations (%): global/test_acc_mean_last10" in done.stdout
    assert re.search(r"┃ partition ┃ +fedavg ┃ +fedprox ┃", done.stdout)
    again = cli("sweep", "p.yaml", "--out", "sw", "--jobs", "1", cwd=tmp_path)
    assert again.stdout.count(": already done") == 6


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_sweep_progress_on_a_terminal_shows_counts_and_eta(tmp_path):
    spec = {"name": "tty", "base": {"rounds": 2, "partition.num_clients": 6, "clients_per_round": 3,
                                    "local_epochs": 1, "model.hidden": [16]}, "methods": ["fedavg"],
            "seeds": [0, 1, 2]}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(spec))
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "fedskew.cli", "sweep", "t.yaml", "--out", "sw", "--jobs", "1",
                             "--no-report"], cwd=tmp_path, env={**ENV, "TERM": "xterm"}, stdin=slave, stdout=slave,
                            stderr=slave)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the process closed the terminal
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=300)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace"))
    assert proc.returncode == 0
    assert re.search(r"\d/3 runs \(\d running, 0 failed\), [1-5]/6 rounds; \d+:\d\d elapsed, ETA \d+:\d\d", text)
    assert "3/3 runs (0 running, 0 failed), 6/6 rounds" in text


# ---------------------------------------------------------------------------------------------
# Multirun, --print-config, `fedskew methods`, partition


def test_split_multirun_keeps_bracketed_lists_whole():
    single, multi = split_multirun(["method=fedavg,fedmr", "model.hidden=[64,32]", "seed=0,1,2", "lr=0.1",
                                    "method.mu1=0.01,0.1"])
    assert single == ["model.hidden=[64,32]", "lr=0.1"]
    assert multi == {"method": ["fedavg", "fedmr"], "seed": [0, 1, 2], "method.mu1": [0.01, 0.1]}
    # README's `fedskew run logger=tensorboard,mlflow` is one run logging to both, not two runs
    single, multi = split_multirun(["logger=tensorboard,mlflow", "lr=0.1,0.2"])
    assert single == ["logger=tensorboard,mlflow"] and multi == {"lr": [0.1, 0.2]}


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_multirun_is_a_sweep_stored_and_reported_like_one(tmp_path):
    done = cli("run", "method=fedavg,fedprox", "seed=0,1", "lr=0.01,0.05", "rounds=2", *TINY, "--jobs", "2",
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (folder,) = (tmp_path / "runs").glob("multirun-*")
    rows = fedskew.load_results(folder, frame=False)
    assert len(rows) == 8 and {r["status"] for r in rows} == {"done"}
    assert {r["label"] for r in rows} == {"fedavg lr=0.01", "fedavg lr=0.05", "fedprox lr=0.01", "fedprox lr=0.05"}
    configs = [yaml.safe_load((Path(r["run_dir"]) / "config.yaml").read_text()) for r in rows]
    assert sorted({(c["method"]["name"], c["lr"], c["seed"]) for c in configs}) == sorted(
        (m, lr, s) for m in ("fedavg", "fedprox") for lr in (0.01, 0.05) for s in (0, 1))
    assert all(c["model"]["hidden"] == [16] for c in configs)
    assert (folder / "report" / "report.md").is_file()


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_a_multirun_of_methods_without_a_global_model_reports_their_personalised_accuracy(tmp_path):
    """`fedskew run method=gpfl seed=0,1` (no global model, as FedCP, pFedHN, FedRep): the report's
    default metric falls back to the personalised accuracy instead of refusing the global one the
    runs do not have (it ended with "report metric ... is in no finished run's summary", exit 2)."""
    done = cli("run", "method=gpfl", "seed=0,1", "rounds=2", "final_personalization=false", *TINY, "--jobs", "1",
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert re.search(r"gpfl .*s0: personal \d+\.\d\d% \(", done.stdout) and "global" not in done.stdout, done.stdout
    (folder,) = (tmp_path / "runs").glob("multirun-*")
    report = (folder / "report" / "report.md").read_text()
    assert "personal/acc_after" in report


def test_print_config_shows_every_default_and_runs_back(tmp_path):
    done = cli("run", "--print-config", "method=map", "rounds=7", cwd=tmp_path)
    assert done.returncode == 0 and not list(tmp_path.glob("runs"))  # nothing ran
    printed = yaml.safe_load(done.stdout)
    assert printed["rounds"] == 7 and printed["model"]["classifier_bias"] is False
    assert printed["method"]["alpha"] == 0.9 and printed["method"]["schedule"] == "code"  # the method's defaults
    (tmp_path / "printed.yaml").write_text(done.stdout)
    again, direct = load_config(tmp_path / "printed.yaml"), load_config(None, ["method=map", "rounds=7"])
    assert again.model_dump(exclude={"method"}) == direct.model_dump(exclude={"method"})
    assert again.method.options == {k: v for k, v in printed["method"].items() if k != "name"}


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_methods_command_lists_every_method_by_family_one_line_each(tmp_path):
    from fedskew.cli import FAMILIES

    done = cli("methods", cwd=tmp_path, env={**ENV, "COLUMNS": "250"})
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    for name, cls in METHODS.items():  # one line a method, under its family's heading
        mine = [i for i, line in enumerate(lines) if re.match(rf"  {re.escape(name)} +\S", line)]
        assert len(mine) == 1, name
        heading = next(line for line in reversed(lines[:mine[0]]) if not line.startswith(" "))
        assert heading == FAMILIES[family_of(cls)], (name, heading)
    assert len(lines) == len(METHODS) + len(FAMILIES) + 1 and lines[-1].startswith(f"{len(METHODS)} methods.")
    # (not cut at 'Sec.')
    assert re.search(r"  localghbm +LocalGHBM \(Zaccone et al\., TMLR 2025, Sec\. 4, ", done.stdout)
    one = cli("methods", "fedmr", cwd=tmp_path, env={**ENV, "COLUMNS": "250"})
    assert one.returncode == 0 and re.search(r"method\.mu1 +│ 0\.01 +│ float >= 0 +│ weight of L_intra", one.stdout)
    assert re.search(r"method\.inter_classes +│ 'all' +│ all \| local +│ classes j that L_inter", one.stdout)
    map_ = cli("methods", "map", cwd=tmp_path, env={**ENV, "COLUMNS": "250"}).stdout
    for option, allowed in (("kt", "kd | mmd"), ("kd_form", "paper | code"), ("rs_form", "hard | soft")):
        assert re.search(rf"method\.{option} +│ '\w+' +│ {re.escape(allowed)} +│ \w", map_), option
    bad = cli("methods", "fedmrr", cwd=tmp_path)
    assert bad.returncode == 2 and "(did you mean 'fedmr'?)" in bad.stderr
    assert "the nearest names: fedmr, fedcm, fedrs (`fedskew methods` lists all" in bad.stderr
    assert "fedavg" not in bad.stderr and bad.stderr.count("\n") == 1  # three names, not the registry


def test_partition_writes_into_the_out_dir(tmp_path):
    done = cli("partition", "out_dir=out", "seed=3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "partition-digits-pcdd-s3.png").is_file() and not (tmp_path / "partition.png").exists()


# ---------------------------------------------------------------------------------------------
# Reproducibility record


def test_every_run_records_where_it_ran(tmp_path, sweep_with_a_failure):
    import numpy
    import torch

    def stop(record):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # interrupted after round 1 of 2: resumed below
        fedskew.run(rounds=2, out_dir=str(tmp_path), run_name="e", final_personalization=False, on_round=stop)
    res = fedskew.run(rounds=1, out_dir=str(tmp_path), run_name="e1", final_personalization=False)
    env = yaml.safe_load((tmp_path / "e1" / "config.yaml").read_text())["environment"]
    assert env == res.environment
    assert env["torch_threads"] == torch.get_num_threads() and env["torch"] == str(torch.__version__)
    assert env["numpy"] == numpy.__version__ and env["device"] == "cpu" and env["fedskew"] == fedskew.__version__
    if (Path(fedskew.__file__).parents[2] / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", env["git_commit"])
    rows = fedskew.load_results(sweep_with_a_failure, frame=False)
    done = [r for r in rows if r["status"] == "done"]
    assert done and all(r["env/torch_threads"] == torch.get_num_threads() for r in done)
    assert all(r["env/torch"] == env["torch"] for r in done)
    # a resumed run keeps the record of its earlier part when the environment changed
    cfg = yaml.safe_load((tmp_path / "e" / "config.yaml").read_text())
    cfg["environment"]["torch_threads"] = 99
    (tmp_path / "e" / "config.yaml").write_text(yaml.safe_dump(cfg))
    fedskew.resume(tmp_path / "e")
    after = yaml.safe_load((tmp_path / "e" / "config.yaml").read_text())
    assert after["environment_previous"][0]["torch_threads"] == 99 and after["environment"] == env


def test_a_clone_named_fedskew_beside_a_script_does_not_shadow_the_package(tmp_path):
    """A script run from the folder that holds a clone named ``fedskew/``: with the package under
    ``src/``, the clone's root is at most a namespace portion, and the installed package (a regular
    one, found later on ``sys.path``) wins, silently."""
    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "fedskew").symlink_to(repo, target_is_directory=True)
    (tmp_path / "script.py").write_text("import fedskew\nprint(fedskew.run.__module__, fedskew.__version__)\n"
                                        "print(fedskew.__file__)\n")
    env = {**os.environ, "PYTHONPATH": ""}
    out = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["fedskew", fedskew.__version__] and out.stderr == ""
    assert Path(lines[1]).resolve() == Path(fedskew.__file__).resolve()


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
@pytest.mark.parametrize("guarded, own_method", [(False, False), (False, True), (True, True)])
def test_an_unguarded_parallel_sweep_in_a_script_runs_once_or_is_one_sentence(tmp_path, guarded, own_method):
    """README's snippet without ``if __name__ == "__main__":`` made every spawned worker start the
    sweep again (9 min of cascading tracebacks). The workers no longer import the script
    (pool.script_hidden), so such a sweep simply runs; only a script that defines a method of its
    own must be imported by them, and there the unguarded line is named before any worker starts."""
    method = "fedavg"
    header = "import fedskew\n\n"
    if own_method:
        header += "@fedskew.register_method\nclass Mine(fedskew.Method):\n    name = 'mine'\n\n\n"
        method = "mine"
    call = ('fedskew.sweep({"name": "g", "base": {"rounds": 1, "partition.num_clients": 4, "clients_per_round": 2, '
            f'"local_epochs": 1}}, "methods": ["{method}"], "seeds": [0, 1]}}, jobs=2, out="sw")')
    body = "def main():\n    " + call + "\n\n" + ('if __name__ == "__main__":\n    main()\n' if guarded else "main()\n")
    (tmp_path / "script.py").write_text(header + body)
    out = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if guarded or not own_method:
        assert out.returncode == 0, out.stderr
        assert [r["status"] for r in fedskew.load_results(tmp_path / "sw", frame=False)] == ["done", "done"]
    else:
        line = header.count("\n") + 4  # main() at the end
        assert out.returncode == 1 and out.stderr.count("Traceback") == 1
        assert (f"{tmp_path / 'script.py'}, line {line}, calls fedskew.sweep(jobs=2) outside `if __name__ == "
                f"\"__main__\":`") in out.stderr
        assert not (tmp_path / "sw").exists()


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_a_parallel_sweep_reports_every_workers_rounds_to_python(tmp_path, capsys):
    """Progress per round across workers (before: only when a run finished, "ETA ?" for the whole
    first run), an ETA from the measured round rate, and a plain line from ``fedskew.sweep``."""
    spec = {"name": "p", "base": {"rounds": 3, "partition.num_clients": 4, "clients_per_round": 2,
                                  "local_epochs": 1, "model.hidden": [16]}, "methods": ["fedavg"], "seeds": [0, 1]}
    events, snaps = [], []
    fedskew.sweep(spec, jobs=2, out=tmp_path / "sw", on_event=lambda kind, run: events.append((kind, run)),
                  on_progress=snaps.append, progress=True)
    rounds = [(run["run_id"], run["round"], run["rounds"]) for kind, run in events if kind == "round"]
    assert sorted(rounds) == sorted((rid, k, 3) for rid in {r[0] for r in rounds} for k in (1, 2, 3))
    assert len({r[0] for r in rounds}) == 2  # both workers' runs, each round of each
    first_done = next(i for i, (kind, _) in enumerate(events) if kind == "done")
    assert any(kind == "round" for kind, _ in events[:first_done])  # rounds arrive while runs are running
    assert [s["rounds_done"] for s in snaps] == sorted(s["rounds_done"] for s in snaps)  # never goes back
    assert snaps[-1] | {"elapsed_s": 0, "eta_s": 0} == {"runs_done": 2, "runs_failed": 0, "runs_running": 0,
                                                       "runs_total": 2, "rounds_done": 6, "rounds_total": 6,
                                                       "elapsed_s": 0, "eta_s": 0}
    # an ETA from the second round report on (the rate from the first round, not from the workers' start)
    assert snaps[-1]["eta_s"] == 0 and all(s["eta_s"] is not None for s in snaps[-3:])
    err = capsys.readouterr().err
    assert "fedskew sweep: 2/2 runs (0 running, 0 failed), 6/6 rounds; " in err


def test_sweep_progress_counts_rounds_by_hand(monkeypatch):
    import fedskew.experiments.sweep as sweep_module
    from fedskew.experiments.sweep import SweepProgress, progress_line

    clock = [0.0]
    monkeypatch.setattr(sweep_module.time, "perf_counter", lambda: clock[0])
    p = SweepProgress(4, 10)
    def run(rid):
        return {"run_id": rid, "config": {"rounds": 10}}
    p.update("skipped", run("s"))                      # finished earlier: its rounds done, not trained
    p.update("started", run("a"))
    clock[0] = 100.0                                   # 100 s of worker start-up: no round time
    snap = p.update("round", {**run("a"), "round": 4})  # resumed at round 3: one round trained
    assert snap["eta_s"] is None                       # one report: no rate yet ("ETA ?"), not a guess
    clock[0] = 110.0
    snap = p.update("round", {**run("a"), "round": 6})
    assert (snap["rounds_done"], snap["rounds_total"], p.trained, snap["runs_running"]) == (16, 40, 3, 1)
    assert snap["eta_s"] == pytest.approx(24 / (2 / 10))  # 2 rounds in the 10 s since the first report
    p.update("done", run("a"))
    p.update("round", {**run("a"), "round": 10})       # a late report of a finished run changes nothing
    p.update("started", run("r"))
    clock[0] = 120.0
    snap = p.update("done", run("r"))                  # on Ray: no round reports, its rounds count at the end
    assert (snap["runs_done"], snap["rounds_done"], p.trained, snap["runs_running"]) == (3, 30, 13, 0)
    assert snap["eta_s"] == pytest.approx(10 / (12 / 20))  # 16.7 s; counting the start-up: 10 / (13 / 120) = 92 s
    assert progress_line({**snap, "elapsed_s": 75, "eta_s": 3725}) == \
        "3/4 runs (0 running, 0 failed), 30/40 rounds; 1:15 elapsed, ETA 1:02:05"


@pytest.mark.parametrize("word, said", [
    ("swep", "'swep' is not a command (did you mean 'sweep'?); the commands: run, resume,"),
    ("methdos", "(did you mean 'methods'?)"),
    ("xyz", "'xyz' is not a command; the commands:"),
])
def test_a_misspelt_command_gets_the_nearest_one(capsys, word, said):
    from fedskew.cli import main

    assert main([word, "rounds=1"]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1 and "usage:" not in err


def test_the_time_table_names_fedmr_lite_only_when_it_ran():
    from fedskew.experiments.report import time_section
    from fedskew.experiments.selection import Results, Run

    def results(params, spec):
        run = Run("fedmr", "P", 0, params, {"method": "fedmr", "time/round_s_mean": 1.0,
                                            "global/test_acc_mean_last10": 0.5}, [], Path("."))
        return Results(["fedmr"], ["P"], {("fedmr", "P"): [run]}, {}, "s", spec, {})

    metric = "global/test_acc_mean_last10"
    assert "FedMR-Lite" not in time_section(results({}, {"methods": ["fedmr"]}), metric).text
    assert "FedMR-Lite" in time_section(results({"lite_n": 8}, {"methods": ["fedmr"]}), metric).text
    assert "FedMR-Lite" in time_section(results({}, {"methods": [{"name": "fedmr", "options": {"lite_n": 8}}]}),
                                        metric).text
