"""Trust by construction: every file fedskew reads that it did not write goes through one boundary
(fedskew.files), a folder is written only when fedskew made it (or it is empty), every replace is
whole or nothing, an error nobody anticipated is one sentence with a crash report, and a sweep says
its size before it starts. Each finding of the outside audit has a case here in the form it was
found (a real folder, a link, a FIFO, a real process); the fuzzer at the end drives the real
commands with hostile files and holds the property for all of them: exit 0, or a non-zero exit with
one line and no traceback, and nothing outside the folder changed."""

import contextlib
import errno
import hashlib
import io
import json
import math
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedskew
from fedskew import cli as fedskew_cli
from fedskew.config import ConfigError
from fedskew.engine.durable import FolderLock, replace_folder
from fedskew.files import FileProblem, parse_yaml, read_json, read_text

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
TINY = {"rounds": 2, "partition.num_clients": 6, "clients_per_round": 3, "local_epochs": 1, "model.hidden": [16],
        "final_personalization": False}
# the fuzzer's examples per surface: a fixed count inside the suite's time; FEDSKEW_FUZZ_EXAMPLES=500 for a
# long run (CONTRIBUTING.md, "The fuzzer")
EXAMPLES = int(os.environ.get("FEDSKEW_FUZZ_EXAMPLES", "10"))


def cli(*args, cwd, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "fedskew.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env or ENV, timeout=timeout)


def one_sentence(done, text=""):
    assert done.returncode == 2, (done.returncode, done.stderr[-1500:])
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("fedskew: error: ") and text in done.stderr, done.stderr


def main(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """The command line's own entry (argument parsing, the error boundary) in this process."""
    out, err = io.StringIO(), io.StringIO()
    before = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = fedskew_cli.main([str(a) for a in argv])
    finally:
        os.chdir(before)
    return code, out.getvalue(), err.getvalue()


def said_once(code: int, out: str, err: str, expect: str = "") -> None:
    """The property: no traceback, no error nobody anticipated (the crash report), and a failure is
    exactly one line."""
    assert "Traceback" not in out + err, err[-2000:]
    assert "unexpected" not in err, err[-2000:]
    if code != 0:
        lines = [ln for ln in err.splitlines() if ln.startswith("fedskew: error:")]
        assert code == 2 and len(lines) == 1, (code, err[-2000:])
    assert expect in err, err[-2000:]


def digests(folder: Path) -> dict:
    """Every file's SHA-256 but fedskew's own lock (a refused sweep may have taken its folder's lock)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink() and p.name != ".fedskew.lock"}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished sweep of two methods (its runs are finished run folders), made once for this module."""
    root = tmp_path_factory.mktemp("finished")
    with contextlib.redirect_stdout(io.StringIO()):
        fedskew.sweep({"name": "tiny", "base": TINY, "methods": ["fedavg", "fedprox"], "seeds": [0]},
                      out=root / "sweep", jobs=1)
    return root / "sweep"


def copy_of(finished: Path, into: Path) -> Path:
    target = into / "sweep"
    shutil.copytree(finished, target, ignore=shutil.ignore_patterns(".fedskew.lock", "report"))
    return target


def a_run(sweep: Path) -> Path:
    return sorted((sweep / "runs").iterdir())[0]


# -- the reader ----------------------------------------------------------------------------------


def test_the_reader_refuses_what_is_not_a_regular_file_before_reading_a_byte(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "dir").mkdir()
    (tmp_path / "big.json").write_bytes(b" " * 100)
    (tmp_path / "ok.json").write_text('{"a": 1}')
    (tmp_path / "link.json").symlink_to(tmp_path / "ok.json")
    with pytest.raises(FileProblem, match="is a FIFO .named pipe., not a regular file"):
        read_text(fifo, "board")  # (opened without blocking: no writer, no hang)
    with pytest.raises(FileProblem, match="is a character device"):
        read_text(tmp_path / "zero", "board")
    with pytest.raises(FileProblem, match="is a folder"):
        read_text(tmp_path / "dir", "board")
    with pytest.raises(FileProblem, match="is 100 bytes; such a file is at most 10 bytes"):
        read_text(tmp_path / "big.json", "record", limit=10)
    assert read_json(tmp_path / "link.json", "record") == {"a": 1}  # a file the user named: links followed
    with pytest.raises(FileProblem, match="is a symbolic link; fedskew does not follow a link where it keeps"):
        read_json(tmp_path / "link.json", "record", own=True)  # fedskew's own file: never through a link
    with pytest.raises(FileProblem, match="does not exist"):
        read_json(tmp_path / "none.json", "record")


def test_the_reader_decodes_strictly_and_bounds_nesting_and_aliases(tmp_path):
    (tmp_path / "bytes.yaml").write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(FileProblem, match=r"is not UTF-8 text \(byte 6 is 0xff\)"):
        read_text(tmp_path / "bytes.yaml", "sweep file")
    for text in ("a: " + "[" * 20_000 + "]" * 20_000, "a: " + "{x: " * 100 + "1" + "}" * 100):
        with pytest.raises(FileProblem, match="nests deeper than 64 levels"):
            parse_yaml(text, "sweep file 'x'")
    bomb = "a: &a [1]\n" + "".join(f"b{i}: &b{i} [*a, *a]\n" for i in range(30))
    with pytest.raises(FileProblem, match="more than 20 aliases"):
        parse_yaml(bomb, "config file 'x'")
    with pytest.raises(FileProblem, match="could not determine a constructor for the tag"):
        parse_yaml("name: !!python/object/apply:os.system ['true']", "sweep file 'x'")
    (tmp_path / "deep.json").write_text("[" * 20_000 + "]" * 20_000)
    with pytest.raises(FileProblem, match="nests deeper than 64 levels"):
        read_json(tmp_path / "deep.json", "summary")
    (tmp_path / "nan.json").write_text('{"a": NaN, "b": -Infinity}')
    value = read_json(tmp_path / "nan.json", "summary")
    assert math.isnan(value["a"]) and value["b"] == -math.inf
    with pytest.raises(FileProblem, match="NaN is not a number this file may hold"):
        read_json(tmp_path / "nan.json", "campaign record", finite=True)


# -- the writer ----------------------------------------------------------------------------------


def test_a_lock_file_that_is_a_link_a_hard_link_or_a_fifo_is_never_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    for kind in ("symlink", "hardlink", "fifo", "dangling"):
        folder = tmp_path / kind
        folder.mkdir()
        lock = folder / ".fedskew.lock"
        if kind == "symlink":
            lock.symlink_to(victim)
        elif kind == "hardlink":
            os.link(victim, lock)
        elif kind == "fifo":
            os.mkfifo(lock)
        else:
            lock.symlink_to(tmp_path / "new-file")
        with pytest.raises(ConfigError, match="is not a lock file of fedskew's"):
            FolderLock(folder, "sweep folder").acquire()
        assert victim.read_text() == "the user's file"
        assert not (tmp_path / "new-file").exists()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with FolderLock(fresh, "sweep folder"):
        assert (fresh / ".fedskew.lock").read_text() == str(os.getpid())


@pytest.mark.slow  # starts processes: left out of the fast subset
def test_resume_sweep_and_bench_never_write_through_a_linked_lock(tmp_path, finished):
    """The audit's finding: a folder from elsewhere whose .fedskew.lock links to a user's file had
    that file truncated and a PID written into it by resume, sweep --out and bench --out."""
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    sweep = copy_of(finished, tmp_path)
    run = a_run(sweep)
    (run / ".fedskew.lock").symlink_to(victim)
    one_sentence(cli("resume", run, "rounds=3", cwd=tmp_path), "is not a lock file of fedskew's")
    (sweep / ".fedskew.lock").symlink_to(victim)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump({"name": "tiny", "base": TINY, "methods": ["fedavg"]}))
    one_sentence(cli("sweep", "tiny.yaml", "--out", sweep, cwd=tmp_path), "is not a lock file of fedskew's")
    part = tmp_path / "bench" / "label-skew-digits"
    part.mkdir(parents=True)
    (part / ".fedskew.lock").symlink_to(victim)
    one_sentence(cli("bench", "label-skew", "--scale", "smoke", "--methods", "fedavg", "--out", tmp_path / "bench",
                     cwd=tmp_path), "is not a lock file of fedskew's")
    assert victim.read_text() == "the user's file"


def test_a_sweep_never_replaces_a_file_of_the_users(tmp_path, finished):
    """`fedskew sweep exp/sweep.yaml --out exp` rewrote the user's sweep file, and a sweep into a folder
    with the user's report/report.md replaced it: a folder no sweep of fedskew made is one sentence."""
    exp = tmp_path / "exp"
    exp.mkdir()
    mine = "# my sweep: keep these comments\nname: tiny\nbase: " + json.dumps(TINY) + "\nmethods: [fedavg]  # one\n"
    (exp / "sweep.yaml").write_text(mine)
    spec = yaml.safe_load(mine)
    with pytest.raises(ConfigError, match="already holds files that no fedskew sweep wrote .sweep.yaml."):
        fedskew.sweep(exp / "sweep.yaml", out=exp)
    assert (exp / "sweep.yaml").read_text() == mine and sorted(os.listdir(exp)) == ["sweep.yaml"]
    notes = tmp_path / "notes"
    (notes / "report").mkdir(parents=True)
    (notes / "report" / "report.md").write_text("my report")
    with pytest.raises(ConfigError, match="already holds files that no fedskew sweep wrote .report."):
        fedskew.sweep(spec, out=notes)
    assert digests(notes) == {"report/report.md": hashlib.sha256(b"my report").hexdigest()}
    # a sweep's own folder whose record the user edited: the record is not replaced
    sweep = copy_of(finished, tmp_path)
    edited = "# edited\n" + (sweep / "sweep.yaml").read_text()
    (sweep / "sweep.yaml").write_text(edited)
    before = digests(sweep)
    with pytest.raises(ConfigError, match="is not the record fedskew writes of a sweep"):
        fedskew.sweep({"name": "tiny", "base": TINY, "methods": ["fedavg", "fedprox"], "seeds": [0]}, out=sweep)
    assert digests(sweep) == before


def test_a_folder_replaced_on_a_full_disk_is_left_whole(tmp_path, monkeypatch):
    """gpu_merge replaced a campaign step by deleting it and copying the new one: a full disk left it
    half-copied. replace_folder copies beside it and renames: the old folder stays whole."""
    old, new = tmp_path / "step", tmp_path / "incoming"
    for folder, text in ((old, "old"), (new, "new")):
        (folder / "part").mkdir(parents=True)
        for i in range(3):
            (folder / "part" / f"{i}.json").write_text(f"{text} {i}")
    before = digests(old)
    copied = []

    def full_disk(src, dst, *args, **kw):
        if copied:
            raise OSError(errno.ENOSPC, "No space left on device", dst)
        copied.append(dst)
        return shutil.copy2(src, dst)

    monkeypatch.setattr(shutil, "copy2", full_disk)
    with pytest.raises(OSError, match="No space left"):
        replace_folder(new, old)
    assert digests(old) == before and sorted(p.name for p in tmp_path.iterdir()) == ["incoming", "step"]
    monkeypatch.undo()
    replace_folder(new, old)
    assert digests(old) == digests(new) and sorted(p.name for p in tmp_path.iterdir()) == ["incoming", "step"]


# -- what the commands read ------------------------------------------------------------------------


SWEEP_RECORDS = {
    "a YAML tag": (b"name: !!python/object/apply:os.system ['touch PWNED']\nmethods: [fedavg]\n",
                   "could not determine a constructor"),
    "a list": (b"[1, 2]\n", "must hold a mapping of keys, not a list"),
    "non-UTF-8 bytes": (b"name: \xff\n", "is not UTF-8 text"),
    "20,000 brackets": (b"a: " + b"[" * 20_000 + b"]" * 20_000, "nests deeper than 64 levels"),
    "a wrong type": (b"name: tiny\nmethods: [fedavg]\nseeds: {a: 1}\n", "sweep key 'seeds'"),
    "a report option of the wrong type": (b"name: tiny\nmethods: [fedavg]\nreport: {metric: [1, 2]}\n",
                                          "sweep key 'report.metric'"),
}


@pytest.mark.parametrize("case", sorted(SWEEP_RECORDS))
def test_a_report_on_a_crafted_sweep_record_is_one_sentence(tmp_path, finished, case):
    sweep = copy_of(finished, tmp_path)
    text, expect = SWEEP_RECORDS[case]
    (sweep / "sweep.yaml").write_bytes(text)
    said_once(*main(["report", sweep], tmp_path), expect=expect)
    assert not (tmp_path / "PWNED").exists() and not (sweep / "report").exists()


def test_a_report_on_a_sweep_record_that_is_a_fifo_or_a_link_is_one_sentence(tmp_path, finished):
    sweep = copy_of(finished, tmp_path)
    (sweep / "sweep.yaml").unlink()
    os.mkfifo(sweep / "sweep.yaml")
    said_once(*main(["report", sweep], tmp_path), expect="is a FIFO (named pipe), not a regular file")
    (sweep / "sweep.yaml").unlink()
    (sweep / "sweep.yaml").symlink_to("/dev/zero")
    said_once(*main(["report", sweep], tmp_path), expect="is a symbolic link")


def test_a_partition_picture_linked_to_a_device_or_a_fifo_is_left_out_of_the_report(tmp_path, finished):
    sweep = copy_of(finished, tmp_path)
    for run, kind in zip(sorted((sweep / "runs").iterdir()), ("devzero", "fifo")):
        _special(run / "partition.png", kind)
    code, out, err = main(["report", sweep], tmp_path)
    said_once(code, out, err)
    assert code == 0 and "Partition:" not in (sweep / "report" / "report.md").read_text()


def test_a_report_on_crafted_results_is_one_sentence_or_the_report(tmp_path, finished):
    """NaN and Infinity in a summary (a diverged run's, or an edited one) are no value; a summary or
    a grid point that is not a JSON mapping is one sentence naming the database and the run."""
    sweep = copy_of(finished, tmp_path)
    db = sqlite3.connect(sweep / "results.sqlite")
    (run_id, summary), = db.execute("SELECT run_id, summary FROM runs WHERE label='fedavg'").fetchall()
    summary = json.loads(summary)
    summary["global/test_acc_mean_last10"] = float("nan")
    summary["global/test_acc"] = "high"
    db.execute("UPDATE runs SET summary=? WHERE run_id=?", (json.dumps(summary), run_id))
    db.commit()
    code, out, err = main(["report", sweep], tmp_path)
    said_once(code, out, err)
    assert code == 0 and (sweep / "report" / "report.md").is_file()
    for value in ("[1, 2]", "[" * 5000 + "]" * 5000):
        db.execute("UPDATE runs SET summary=? WHERE run_id=?", (value, run_id))
        db.commit()
        said_once(*main(["report", sweep], tmp_path), expect="'s summary is not a JSON mapping")
    # a grid point that is not JSON is no point of the sweep's grid: the run is left out, not a traceback
    db.execute("UPDATE runs SET summary=?, params=? WHERE run_id=?", (json.dumps(summary), "{not json", run_id))
    db.commit()
    said_once(*main(["report", sweep], tmp_path))
    db.close()


BOARDS = {"empty": b"", "short rows": b"## global\n\n| method | avg rank | a |\n|---|---|---|\n| fedavg |\n| x | 1 |\n",
          "binary": bytes(range(256)), "no title": b"| method | avg rank |\n|---|---|\n| fedavg | 1.00 |\n"}


@pytest.fixture(scope="module")
def bench_folder(finished, tmp_path_factory) -> Path:
    """A label-skew smoke folder whose one part holds the finished sweep's runs."""
    folder = tmp_path_factory.mktemp("bench") / "bench"
    shutil.copytree(finished, folder / "label-skew-digits", ignore=shutil.ignore_patterns(".fedskew.lock", "report"))
    (folder / "bench.yaml").write_text(yaml.safe_dump({"suite": "label-skew", "scale": "smoke"}))
    return folder


@pytest.mark.parametrize("case", [*sorted(BOARDS), "/dev/zero", "a FIFO", "a folder"])
def test_beside_a_hostile_board_is_one_sentence(tmp_path, bench_folder, case):
    board = tmp_path / "board.md"
    if case in BOARDS:
        board.write_bytes(BOARDS[case])
    elif case == "a FIFO":
        os.mkfifo(board)
    elif case == "a folder":
        board.mkdir()
    else:
        board = Path(case)
    said_once(*main(["bench", "label-skew", "--scale", "smoke", "--out", bench_folder, "--report", "--beside",
                     board], tmp_path), expect="--beside")


def test_bench_report_on_a_folder_without_runs_writes_nothing(tmp_path):
    """After `bench --strict` refused a dirty tree, `--report` on the empty folder exited 0 with an empty
    board, and every bench into the folder was refused after it."""
    folder = tmp_path / "board"
    folder.mkdir()
    said_once(*main(["bench", "label-skew", "--scale", "smoke", "--out", folder, "--report"], tmp_path),
              expect="holds no runs of suite 'label-skew'")
    assert list(folder.iterdir()) == []


def test_a_checkpoint_linked_to_a_device_or_a_fifo_is_not_read(tmp_path, finished):
    """checkpoint.pt linked to /dev/zero was read to 2.5 GiB; a FIFO hung resume for ever."""
    run = a_run(copy_of(finished, tmp_path))
    (run / "checkpoint.pt").unlink()
    (run / "checkpoint.pt").symlink_to("/dev/zero")
    (run / "checkpoint.prev.pt").unlink()
    os.mkfifo(run / "checkpoint.prev.pt")
    said_once(*main(["resume", run], tmp_path), expect="checkpoint.pt: it is a symbolic link")


def test_seeds_beyond_64_bits_and_oversized_sweeps_are_refused_before_anything_starts(tmp_path):
    said_once(*main(["run", f"seed={2 ** 70}", "--print-config"], tmp_path), expect="config key 'seed'")
    for spec, expect in (({"seeds": [2 ** 70]}, "sweep key 'seeds.0'"),
                         ({"seeds": list(range(100_000))}, "the sweep plans 100,000 runs, more than 10,000"),
                         ({"methods": [{"name": "fedprox", "options": {"mu": list(range(1000)),
                                                                       "lr": [i / 1000 for i in range(1000)]}}]},
                          "the sweep plans 1,000,000 runs")):
        (tmp_path / "s.yaml").write_text(yaml.safe_dump({"name": "big", "methods": ["fedavg"], **spec}))
        said_once(*main(["sweep", "s.yaml", "--out", "o"], tmp_path), expect=expect)
        assert not (tmp_path / "o").exists()


@pytest.mark.slow  # starts processes: left out of the fast subset
def test_an_error_nobody_anticipated_is_one_sentence_with_a_crash_report(tmp_path):
    script = textwrap.dedent("""
        import sys
        import fedskew.cli as cli
        def broken(args, console):
            raise RuntimeError("a bug\\nsecond line")
        cli.cmd_methods = broken
        cli.entry()
    """)
    env = {**ENV, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script, "methods"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("fedskew: error: methods failed with an unexpected RuntimeError (a bug); the "
                                  "traceback is in "), done.stderr
    report = Path(done.stderr.split("the traceback is in ")[1].split(";")[0])
    assert report.parent == tmp_path and "RuntimeError: a bug" in report.read_text()
    debug = subprocess.run([sys.executable, "-c", script, "methods"], capture_output=True, text=True,
                           env={**env, "FEDSKEW_DEBUG": "1"}, timeout=300)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "RuntimeError: a bug" in debug.stderr


def test_a_tracker_that_cannot_start_is_one_sentence_and_nothing_trains(tmp_path, monkeypatch):
    base = [f"{k}={json.dumps(v)}" for k, v in TINY.items()]
    monkeypatch.setenv("WANDB_MODE", "bogus")
    said_once(*main(["run", "logger=wandb", "run_name=w", *base], tmp_path),
              expect="tracker 'wandb' (config key 'logger') cannot start: WANDB_MODE is 'bogus'")
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "gopher://example")
    said_once(*main(["run", "logger=mlflow", "run_name=m1", *base], tmp_path),
              expect="has the scheme 'gopher'")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    (tmp_path / "runs" / "mlflow.db").mkdir(parents=True)
    said_once(*main(["run", "logger=mlflow", "run_name=m2", *base], tmp_path), expect="mlflow.db' is not a file")
    assert all((tmp_path / "runs" / name / "metrics.jsonl").read_text() == "" for name in ("w", "m1", "m2"))
    code, out, err = main(["resume", tmp_path / "runs" / "w", "logger=[]"], tmp_path)  # what the sentence says
    said_once(code, out, err)
    assert code == 0 and json.loads((tmp_path / "runs" / "w" / "summary.json").read_text())["rounds"] == 2


@pytest.mark.slow  # imports MLflow and trains: left out of the fast subset
def test_mlflow_tracks_a_run_whose_path_holds_a_quote(tmp_path):
    """MLflow's search filter broke on a ' in the run folder's path (a traceback); the run is found by
    a filter-safe key of its path, and resuming continues the same MLflow run."""
    out = tmp_path / "it's here"
    result = fedskew.run(logger=["mlflow"], out_dir=str(out), run_name="q", **{**TINY, "rounds": 1})
    resumed = fedskew.resume(result.run_dir, rounds=2)
    assert resumed.summary["rounds"] == 2
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("fedskew").experiment_id])
    assert len(runs) == 1 and runs[0].data.tags["run_dir"] == str(result.run_dir.resolve())


# -- the fuzzer ------------------------------------------------------------------------------------

HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2 ** 80), max_value=2 ** 80),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.lists(st.integers(), max_size=4), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    st.integers(min_value=65, max_value=300).map(lambda n: _nested(n)),
)


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _paths(value, prefix=()):
    """Every place in a parsed file (dict keys and list indices), the root included."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:5]):
            yield from _paths(v, (*prefix, i))


def _set(value, path, new):
    if not path:
        return new
    value = json.loads(json.dumps(value, allow_nan=True))
    node = value
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = new
    return value


@st.composite
def hostile_file(draw, parsed, dump):
    """Bytes for a file whose good content parses to ``parsed``: one value at a random place replaced by a
    hostile one (wrong type, huge, NaN, nested 65-300 deep), or bytes that are no text, or nothing."""
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "bytes", "empty", "truncate"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "empty":
        return b""
    good = dump(parsed)
    if kind == "truncate":
        return good[:draw(st.integers(min_value=0, max_value=len(good)))]
    path = draw(st.sampled_from(list(_paths(parsed))))
    return dump(_set(parsed, path, draw(HOSTILE)))


def _json(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def _yaml(value) -> bytes:
    return yaml.safe_dump(value, sort_keys=False).encode()


SPECIALS = st.sampled_from(["fifo", "devzero", "folder", "dangling"])


def _special(path: Path, kind: str) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    {"fifo": lambda: os.mkfifo(path), "devzero": lambda: path.symlink_to("/dev/zero"), "folder": path.mkdir,
     "dangling": lambda: path.symlink_to(path.parent / "nowhere")}[kind]()


# the suite's examples are the same every run (derandomize); FEDSKEW_FUZZ_RANDOM=1 draws new ones
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                derandomize=not os.environ.get("FEDSKEW_FUZZ_RANDOM"), suppress_health_check=list(HealthCheck))


def _fuzz_one(finished, tmp, target: str, content, argv) -> None:
    """Write ``content`` (bytes, or a special kind of file) at ``target`` in a copy of the finished
    sweep, run ``argv`` there, and hold the property; a file beside the copy must not change."""
    tmp = Path(tmp)
    sweep = copy_of(finished, tmp)
    sentinel = tmp / "sentinel.txt"
    sentinel.write_text("outside")
    path = sweep / target.replace("RUN", a_run(sweep).name)
    if isinstance(content, bytes):
        if path.is_dir():
            shutil.rmtree(path)
        path.write_bytes(content)
    else:
        _special(path, content)
    code, out, err = main([a.replace("SWEEP", str(sweep)).replace("RUN", str(a_run(sweep))) for a in argv], tmp)
    said_once(code, out, err)
    assert sentinel.read_text() == "outside"


@FUZZ
@given(data=st.data())
def test_fuzz_the_sweep_record_through_fedskew_report(finished, data):
    record = yaml.safe_load((finished / "sweep.yaml").read_text())
    content = data.draw(st.one_of(hostile_file(record, _yaml), SPECIALS))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _fuzz_one(finished, tmp, "sweep.yaml", content, ["report", "SWEEP"])


@FUZZ
@given(data=st.data())
def test_fuzz_a_run_folder_through_fedskew_resume(finished, data):
    run = a_run(finished)
    name = data.draw(st.sampled_from(["run.json", "summary.json", "config.yaml", "metrics.jsonl", "checkpoint.pt",
                                      "partition.json"]))
    if name.endswith(".json"):
        content = data.draw(st.one_of(hostile_file(json.loads((run / name).read_text()), _json), SPECIALS))
    elif name == "config.yaml":
        content = data.draw(st.one_of(hostile_file(yaml.safe_load((run / name).read_text()), _yaml), SPECIALS))
    elif name == "metrics.jsonl":
        rows = [json.loads(line) for line in (run / name).read_text().splitlines()]
        content = data.draw(st.one_of(hostile_file(rows, lambda v: b"\n".join(_json(r) for r in v) + b"\n"
                                                   if isinstance(v, list) else _json(v)), SPECIALS))
    else:
        content = data.draw(st.one_of(st.binary(max_size=300), SPECIALS,
                                      st.integers(0, 4000).map(lambda n: (run / name).read_bytes()[:n])))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _fuzz_one(finished, tmp, f"runs/RUN/{name}", content, ["resume", "RUN"])


@FUZZ
@given(data=st.data())
def test_fuzz_the_results_database_through_fedskew_report(finished, data):
    column = data.draw(st.sampled_from(["summary", "params", "config", "environment"]))
    value = data.draw(st.one_of(HOSTILE.map(lambda v: json.dumps(v, allow_nan=True)), st.text(max_size=40)))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        sweep = copy_of(finished, Path(tmp))
        db = sqlite3.connect(sweep / "results.sqlite")
        db.execute(f"UPDATE runs SET {column}=? WHERE label='fedavg'", (value,))
        db.commit()
        db.close()
        said_once(*main(["report", sweep], Path(tmp)))


@FUZZ
@given(data=st.data())
def test_fuzz_a_board_through_bench_beside(bench_folder, data):
    board = (ROOT / "docs" / "leaderboards" / "label-skew-lite.md").read_text()
    lines = board.splitlines()
    cut = data.draw(st.lists(st.integers(0, len(lines) - 1), max_size=40))
    mangled = [ln if i not in cut else data.draw(st.sampled_from(["", "| x |", "|---|", "## global",
                                                                  ln[: len(ln) // 2], ln.replace("|", "")]))
               for i, ln in enumerate(lines)]
    content = data.draw(st.one_of(st.just("\n".join(mangled).encode()), st.binary(max_size=200)))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "board.md").write_bytes(content)
        said_once(*main(["bench", "label-skew", "--scale", "smoke", "--out", bench_folder, "--report", "--beside",
                         Path(tmp) / "board.md"], Path(tmp)))


@FUZZ
@given(data=st.data())
def test_fuzz_a_config_file_through_print_config(data):
    good = {"method": {"name": "fedprox", "mu": 0.01}, "dataset": "digits", "partition": {"name": "dirichlet",
                                                                                          "alpha": 0.5},
            "rounds": 3, "seed": 1, "model": {"name": "mlp", "hidden": [16]}}
    content = data.draw(st.one_of(hostile_file(good, _yaml), SPECIALS))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            _special(path, content)
        said_once(*main(["run", path, "--print-config"], Path(tmp)))


CAMPAIGNS = {"a list": b"[1, 2]", "NaN": b'{"steps": NaN, "windows": []}', "a wrong field": b'{"steps": {"a": 1}}',
             "an unknown field": b'{"steps": {}, "windows": [], "x": 1}', "non-UTF-8": b"\xff", "a FIFO": None}


@pytest.mark.slow  # starts processes: left out of the fast subset
def test_gpu_merge_ranks_on_a_malformed_campaign_root_is_one_sentence(tmp_path):
    """`gpu_merge.py --ranks` read campaign.json and the steps' boards unchecked: a traceback."""
    for case, content in CAMPAIGNS.items():
        root = tmp_path / case.replace(" ", "-")
        shutil.copytree(ROOT / "docs" / "gpu-campaign" / "map-part", root / "map-part")
        if content is None:
            os.mkfifo(root / "campaign.json")
        else:
            (root / "campaign.json").write_bytes(content)
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_merge.py"), "--ranks", "seed-papers",
                               "--campaign-root", str(root)], capture_output=True, text=True, env=ENV, timeout=300)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, (case,
                                                                                                       done.stderr)
        assert "campaign record" in done.stderr, done.stderr
    (root / "campaign.json").unlink()
    (root / "map-part" / "leaderboard.md").unlink()
    os.mkfifo(root / "map-part" / "leaderboard.md")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_merge.py"), "--ranks", "seed-papers",
                           "--campaign-root", str(root)], capture_output=True, text=True, env=ENV, timeout=300)
    # a board that is no regular file is no board: said in a line, no hang
    assert done.returncode == 0 and "no campaign board" in done.stdout and not done.stderr, done.stderr


def test_a_database_of_the_users_in_a_sweep_folder_is_never_given_fedskew_s_tables(tmp_path):
    """`fedskew report DIR` on a folder whose results.sqlite was the user's own database added fedskew's
    tables to it (8 KB to 32 KB) and wrote an empty report; a fedskew database without runs gave an
    empty report with exit 0."""
    (tmp_path / "mine").mkdir()
    db = sqlite3.connect(tmp_path / "mine" / "results.sqlite")
    db.execute("CREATE TABLE notes (text TEXT)")
    db.execute("INSERT INTO notes VALUES ('mine')")
    db.commit()
    db.close()
    before = digests(tmp_path / "mine")
    said_once(*main(["report", tmp_path / "mine"], tmp_path), expect="is not a fedskew results database")
    assert digests(tmp_path / "mine") == before
    (tmp_path / "empty").mkdir()
    from fedskew.experiments.store import connect

    connect(tmp_path / "empty" / "results.sqlite").close()
    said_once(*main(["report", tmp_path / "empty"], tmp_path), expect="holds no finished run")
    assert not (tmp_path / "empty" / "report").exists()


def test_a_run_folder_with_a_deep_metrics_line_or_a_summary_without_its_keys_is_one_sentence(tmp_path, finished):
    run = a_run(copy_of(finished, tmp_path))
    summary = (run / "summary.json").read_text()
    (run / "summary.json").write_text('{"rounds": 2}')
    said_once(*main(["resume", run], tmp_path), expect="field 'method'")
    (run / "summary.json").write_text(summary)
    (run / "metrics.jsonl").write_text("[" * 20_000 + "]" * 20_000 + "\n" + (run / "metrics.jsonl").read_text())
    said_once(*main(["resume", run], tmp_path), expect="line 1 is not a round record")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_every_method_option_through_the_config(data):
    """Any value of any registered method's option on the command line is a config or one sentence
    naming the key, never a traceback (a method registered later joins by being registered)."""
    from fedskew.algorithms import METHODS
    from fedskew.config import load_config

    name = data.draw(st.sampled_from(sorted(METHODS)))
    option = data.draw(st.sampled_from(sorted(METHODS[name].Options.model_fields)))
    value = data.draw(st.one_of(st.integers(-2**70, 2**70).map(str), st.floats(allow_nan=True).map(repr),
                                st.sampled_from(["true", "null", "[]", "{}", "nan", "-inf", "1e400", "'x'", ""]),
                                st.text(max_size=12)))
    try:
        load_config(None, [f"method={name}", f"method.{option}={value}"])
    except ConfigError as exc:
        text = str(exc)
        assert "\n" not in text.strip() and option in text, text
