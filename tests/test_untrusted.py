"""What fedskew reads from folders and archives it did not write is untrusted input: the GPU
window's files brought back (a hostile window.json or archive), a tree with files git does not
track, a commit named by the environment, a config.yaml edited between rounds, options that switch
a method off. Each case in the real form it was found (a real archive, a real folder, a
subprocess): one sentence naming the file and the field, nothing written outside the target, no
file of the user's changed, no traceback. (The run-folder cases: tests/test_first_day.py.)"""

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

import fedskew

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
sys.path.insert(0, str(ROOT / "benchmarks"))
TINY = {"rounds": 4, "partition.num_clients": 6, "clients_per_round": 3, "local_epochs": 1, "model.hidden": [16],
        "final_personalization": False}


def merge(files_at, root):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_merge.py"), str(files_at),
                           "--campaign-root", str(root)], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=600)


def digests(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()} if folder.exists() else {}


def refused(done, text):
    assert done.returncode == 2, (done.returncode, done.stdout[-800:], done.stderr[-1500:])
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert text in done.stderr, done.stderr


@pytest.fixture
def window(tmp_path):
    """A window's files as they come back (this checkout's commit, the test plan's step), a campaign
    root inside a folder of its own (the merge writes beside it, in ``gpu-runs``), and the digests of
    everything around before the merge."""
    from gpu_merge import head_commit

    files, root = tmp_path / "back", tmp_path / "docs" / "campaign"
    files.mkdir()
    record = {"commit": head_commit(), "card": "NVIDIA H200", "started": "2026-11-28 19:16:53 UTC",
              "campaign_step": "smoke-niid", "campaign_complete": True, "seconds": 12.0, "steps": []}
    (files / "window.json").write_text(json.dumps(record))
    return files, root, record


def tarball(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)


def member(name, data=b"x", **kw):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in kw.items():
        setattr(info, k, v)
    return info, data


def _marker_bytes() -> bytes:
    return yaml.safe_dump({"suite": "niid-bench", "scale": "smoke"}).encode()


@pytest.mark.parametrize("started", ["../../../x 12:00:00 UTC", "/abs/olute", "2026-11-28 19:16:53 UTC/../../y"])
def test_a_started_field_cannot_name_a_path(window, tmp_path, started):
    files, root, record = window
    (files / "window.json").write_text(json.dumps({**record, "campaign_step": None, "started": started}))
    (files / "speed.txt").write_text("speed\n")
    before = digests(tmp_path)
    refused(merge(files, root), "window.json's 'started'")
    assert digests(tmp_path) == before


@pytest.mark.parametrize("text, said", [
    ("{not json", "window.json is not valid JSON"),
    ("[1, 2]", "window.json holds a list, not the job's record"),
    (None, "window.json's 'steps.0.name'"),  # a step without a name
    ("steps-list", "window.json's 'steps.0'"),  # a list for a step
])
def test_a_malformed_window_record_is_one_sentence(window, tmp_path, text, said):
    files, root, record = window
    if text is None:
        text = json.dumps({**record, "steps": [{"rc": 0}]})
    elif text == "steps-list":
        text = json.dumps({**record, "steps": [["speed-engine", 0]]})
    (files / "window.json").write_text(text)
    before = digests(tmp_path)
    refused(merge(files, root), said)
    assert digests(tmp_path) == before


@pytest.mark.parametrize("content, said", [
    (b"", "campaign.tar.gz cannot be read"),
    (b"not a gzip file at all", "campaign.tar.gz cannot be read"),
    ("truncated", "campaign.tar.gz cannot be read"),
])
def test_a_broken_archive_is_one_sentence_and_campaign_json_is_untouched(window, tmp_path, content, said):
    files, root, _ = window
    root.mkdir(parents=True)
    (root / "campaign.json").write_text(json.dumps({"steps": {}, "windows": []}))
    if content == "truncated":
        tarball(files / "campaign.tar.gz", [member("bench.yaml", _marker_bytes()), member("a.md", b"x" * 50_000)])
        data = (files / "campaign.tar.gz").read_bytes()
        (files / "campaign.tar.gz").write_bytes(data[: len(data) // 2])
    else:
        (files / "campaign.tar.gz").write_bytes(content)
    before = digests(tmp_path)
    refused(merge(files, root), said)
    assert digests(tmp_path) == before


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_a_bomb_a_set_uid_member_a_link_and_a_path_out_are_refused_or_tamed(window, tmp_path):
    from gpu_merge import MEMBER_BYTES

    files, root, _ = window
    # a member that declares more than the budget (a 1 GiB file compresses to about a megabyte)
    big = tarfile.TarInfo("smoke-niid/huge.md")
    big.size = MEMBER_BYTES + 1
    with tarfile.open(files / "campaign.tar.gz", "w:gz") as tar:
        info, data = member("bench.yaml", _marker_bytes())
        tar.addfile(info, io.BytesIO(data))
        tar.addfile(big, io.BytesIO(b"\0" * (MEMBER_BYTES + 1)))
    before = digests(tmp_path)
    refused(merge(files, root), "over the")
    assert digests(tmp_path) == before
    # a set-uid member is written 0644; a link and a path out of the folder are never extracted
    link = tarfile.TarInfo("evil.md")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    tarball(files / "campaign.tar.gz", [member("bench.yaml", _marker_bytes()),
                                        member("map/setuid.md", b"s", mode=0o4755),
                                        (link, None), member("../../outside.md", b"o")])
    done = merge(files, root)
    assert "Traceback" not in done.stderr
    if done.returncode == 0:
        kept = root / "smoke-niid" / "map" / "setuid.md"
        assert kept.is_file() and (kept.stat().st_mode & 0o7777) == 0o644
        assert not (root / "smoke-niid" / "evil.md").exists()
    else:
        refused(done, "campaign.tar.gz")
    assert not (tmp_path / "outside.md").exists() and not (tmp_path / "docs" / "outside.md").exists()


def test_a_log_that_is_a_link_is_not_followed(window, tmp_path):
    files, root, record = window
    (files / "window.json").write_text(json.dumps({**record, "campaign_step": None}))
    secret = tmp_path / "secret.txt"
    secret.write_text("not the window's")
    (files / "gpu-tests.txt").symlink_to(secret)
    refused(merge(files, root), "gpu-tests.txt' is not a regular file")
    assert not (tmp_path / "docs" / "gpu-runs").exists()


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_complete_only_with_the_runs_there_and_a_late_archive_merges(window, tmp_path):
    """window.json saying the step is complete with no archive records no step; the archive coming
    later is merged, not refused as merged already; an archive with no finished runs is partial."""
    files, root, record = window
    done = merge(files, root)  # no campaign.tar.gz came back
    assert done.returncode == 0, done.stderr
    state = json.loads((root / "campaign.json").read_text())
    assert state["steps"] == {} and "no campaign.tar.gz came back" in done.stdout
    tarball(files / "campaign.tar.gz", [member("bench.yaml", _marker_bytes())])  # a folder with no runs
    done = merge(files, root)
    assert done.returncode == 0, done.stderr
    state = json.loads((root / "campaign.json").read_text())
    assert state["steps"]["smoke-niid"]["status"] == "partial" and len(state["windows"]) == 1
    refused(merge(files, root), "is merged already")


def test_prepare_refuses_a_file_git_does_not_track():
    """The device copy carries untracked files: a window could run code no commit holds. (git's own
    answer for the tracked files is taken as clean here, so the untracked file is what is refused.)"""
    stray = ROOT / "src" / "fedskew" / "zz_untracked_probe.py"
    stray.write_text("X = 1\n")
    try:
        done = subprocess.run([sys.executable, "-c", (
            "import sys; sys.path.insert(0, 'benchmarks'); from fedskew.engine import rundir; "
            "rundir.git_commit = lambda: '0123456789ab'; import gpu_window; sys.exit(gpu_window.prepare())")],
            capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    finally:
        stray.unlink()
    refused(done, "file(s) git does not track and does not ignore")


def test_a_commit_named_by_the_environment_does_not_hide_an_edited_checkout(monkeypatch):
    from fedskew.engine import rundir

    monkeypatch.setattr(rundir, "git_commit", lambda: "0123456789ab+dirty")
    monkeypatch.setenv("FEDSKEW_GIT_COMMIT", "0123456789ab")
    assert rundir.environment(__import__("torch").device("cpu"))["git_commit"] == "0123456789ab+dirty"
    monkeypatch.setattr(rundir, "git_commit", lambda: None)  # a copy without .git: the variable names it
    assert rundir.environment(__import__("torch").device("cpu"))["git_commit"] == "0123456789ab"


def test_bench_strict_on_an_edited_checkout_refuses_before_training(tmp_path):
    done = subprocess.run([sys.executable, "-c", (
        "import sys; from fedskew.engine import rundir; rundir.git_commit = lambda: '0123456789ab+dirty'; "
        "from fedskew.cli import main; sys.exit(main(['bench', 'label-skew', '--scale', 'smoke', '--methods', "
        "'fedavg', '--settings', '#C=2', '--strict', '--out', 'b']))")],
        capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300)
    refused(done, "bench --strict: this checkout has uncommitted changes (0123456789ab+dirty)")
    assert "nothing was trained" in done.stderr and not (tmp_path / "b").exists()


@pytest.mark.parametrize("key, before, after, extra", [
    ("executor", "sequential", "vectorized", {}),
    ("compile", "off", "auto", {"executor": "vectorized"}),  # (on: minutes of compiling on a CPU)
    ("channels_last", "off", "auto", {}),
])
@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_a_config_edited_between_rounds_is_recorded_as_a_change(tmp_path, key, before, after, extra):
    """A run stopped after round 2 whose config.yaml was edited by hand to another executor, compile
    or layout setting: the resume says so and records the edit from round 3, not for every round."""
    def stop(record):
        if record["round"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fedskew.run(on_round=stop, out_dir=str(tmp_path), run_name="r", **{**TINY, key: before, **extra})
    cfg_path = tmp_path / "r" / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg[key] = after
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    done = subprocess.run([sys.executable, "-m", "fedskew.cli", "resume", str(tmp_path / "r")], capture_output=True,
                          text=True, env=ENV, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"config.yaml of '{tmp_path / 'r'}' was edited since its checkpoint ({key}: {before!r} -> {after!r})" \
        in done.stderr
    changes = yaml.safe_load(cfg_path.read_text()).get("changes")
    assert changes == [{"from_round": 3, key: after}], changes


def test_options_that_switch_the_mechanism_off_are_said(tmp_path):
    """FedExP at a vast epsilon extrapolates never; CFL with eps_2 = inf or min_cluster_size past the
    clients never splits: a warning when the run starts (or a refusal for the non-number)."""
    from fedskew.config import ConfigError, InertOptionWarning, load_config

    with pytest.warns(InertOptionWarning, match="epsilon = 1e.308: .* this run is FedAvg in practice"):
        load_config(None, ["method=fedexp", "method.epsilon=1e308"])
    with pytest.warns(InertOptionWarning, match="min_cluster_size = 1000000000 is not below the 20 clients"):
        load_config(None, ["method=cfl", "method.min_cluster_size=1000000000", "method.start_round=0"])
    with pytest.raises(ConfigError, match="method.eps_2 = 'inf' is not allowed"):
        load_config(None, ["method=cfl", "method.eps_2=inf"])


def test_a_results_database_cannot_point_a_report_outside_its_folder(tmp_path):
    """A sweep folder from elsewhere whose results.sqlite names a run id '../..': the report reads
    nothing outside the folder and says so in one sentence."""
    import sqlite3

    spec = {"name": "s", "base": {"rounds": 1, "partition": {"num_clients": 4}, "clients_per_round": 2,
                                  "final_personalization": False}, "methods": ["fedavg"], "seeds": [0]}
    folder = fedskew.sweep(spec, jobs=1, out=tmp_path / "sw", progress=False)
    secret = tmp_path / "partition.png"
    secret.write_bytes(b"not the sweep's")
    db = sqlite3.connect(folder / "results.sqlite")
    db.execute("UPDATE runs SET run_id = '../../..'")
    db.commit()
    db.close()
    done = subprocess.run([sys.executable, "-m", "fedskew.cli", "report", str(folder)], capture_output=True,
                          text=True, env=ENV, cwd=tmp_path, timeout=300)
    refused(done, "which is not a sweep's (12 hexadecimal digits)")


RESULT = {"benchmark": "engine-speed", "title": "Engine speed", "command": "python benchmarks/engine_speed.py",
          "date": "2026-11-28", "commit": "0123456789ab", "hardware": "NVIDIA H200", "torch": "2.11.0+cu130",
          "threads": 16, "columns": ["model", "seq/padded"], "rows": [["mlp", 29.26]], "notes": ""}


def test_a_job_s_benchmark_records_land_as_the_performance_page_reads_them(window, tmp_path):
    files, root, record = window
    (files / "window.json").write_text(json.dumps({**record, "campaign_step": None,
                                                   "results": {"speed-engine": RESULT}}))
    done = merge(files, root)
    assert done.returncode == 0, done.stderr
    landed = root / "results" / "engine-speed-nvidia-h200.json"
    assert json.loads(landed.read_text()) == RESULT


@pytest.mark.parametrize("change, said", [
    ({"benchmark": "../../evil"}, "window.json's 'results.speed-engine.benchmark'"),
    ({"rows": "not a list"}, "window.json's 'results.speed-engine.rows'"),
    ({"extra": 1}, "window.json's 'results.speed-engine.extra'"),
])
def test_a_hostile_benchmark_record_is_one_sentence_and_nothing_lands(window, tmp_path, change, said):
    files, root, record = window
    (files / "window.json").write_text(json.dumps({**record, "campaign_step": None,
                                                   "results": {"speed-engine": {**RESULT, **change}}}))
    before = digests(tmp_path)
    refused(merge(files, root), said)
    assert digests(tmp_path) == before
