"""Beyond one process: one run's clients across torchrun ranks (gloo, 127.0.0.1) must give the
single-process run, and a sweep on a real Ray cluster must give the database ``--jobs 1`` gives.

The torchrun runs use real processes started by ``torchrun --nproc_per_node=2`` (rank 0 writes the
run directory, rank 1 trains its shard of every round's clients). Client states (SCAFFOLD's
controls, MAP's inherited private models) travel with their client each round; every random
stream is named per client and round, so with the sequential executor the two runs agree bit for
bit (asserted exactly); the vectorised executor batches a different set of clients per call, so it
is held to float round-off."""

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# real torchrun ranks and Ray nodes: left out of README's fast subset; one worker runs every test of the group
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("processes")]

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "250"}
SMALL = ["rounds=2", "clients_per_round=6", "local_epochs=2", "final_personalization=false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fedskew_run(out: Path, name: str, extra: list[str], ranks: int = 0) -> Path:
    cmd = [sys.executable, "-m", "fedskew.cli", "run", *SMALL, *extra, f"out_dir={out}", f"run_name={name}"]
    if ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", "-m", "fedskew.cli", "run", *cmd[4:], "distributed=true"]
    # (torchrun keeps its ranks' logs in a new folder of TMPDIR: one beside the test's, in pytest's folder
    # that pytest removes, rather than /tmp's, which nobody does)
    tmp = out.with_name(out.name + "-tmp")
    tmp.mkdir(exist_ok=True)
    done = subprocess.run(cmd, capture_output=True, text=True, env={**ENV, "TMPDIR": str(tmp)}, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return out / name


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(a: Path, b: Path, tol: float) -> None:
    ra, rb = records(a), records(b)
    assert len(ra) == len(rb) == 2
    for x, y in zip(ra, rb):
        assert x["clients"] == y["clients"]
        for key in ("global/test_acc", "train/loss", "personal/acc_before", "personal/acc_after", "comm/up_floats"):
            assert abs(x[key] - y[key]) <= tol, (key, x[key], y[key])
    ca, cb = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (a, b))
    for key, v in ca["global_state"].items():
        assert torch.allclose(v, cb["global_state"][key], atol=tol, rtol=0), key
    assert ca["server_state"].keys() == cb["server_state"].keys()
    assert sorted(ca["client_states"]) == sorted(cb["client_states"])
    for k, state in ca["client_states"].items():
        for key, v in state.items():
            assert torch.allclose(v, cb["client_states"][k][key], atol=tol, rtol=0), (k, key)


@pytest.mark.parametrize("extra", [["method=fedavg"], ["method=scaffold"], ["method=map"]],
                         ids=["fedavg", "scaffold", "map"])
def test_two_torchrun_ranks_give_the_single_process_run(tmp_path, extra):
    extra = [*extra, "executor=sequential"]
    single = fedskew_run(tmp_path, "single", extra)
    spread = fedskew_run(tmp_path, "spread", extra, ranks=2)
    assert_same_run(single, spread, tol=0.0)  # sequential executor: bit for bit
    assert not (tmp_path / "spread" / "rank1").exists() and len(list(tmp_path.iterdir())) == 2  # rank 0 writes


def test_two_torchrun_ranks_with_the_vectorised_executor(tmp_path):
    extra = ["method=scaffold", "executor=vectorized"]
    assert_same_run(fedskew_run(tmp_path, "single", extra), fedskew_run(tmp_path, "spread", extra, ranks=2), tol=1e-5)


def test_distributed_without_torchrun_or_on_flower_is_one_sentence(tmp_path):
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "fedskew.cli", "run", "rounds=1", "distributed=true",
                           f"out_dir={tmp_path}"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "distributed = true needs the process group torchrun describes" in done.stderr
    pytest.importorskip("flwr")
    done = subprocess.run([sys.executable, "-m", "fedskew.cli", "flower", "simulate", "rounds=1", "distributed=true",
                           f"out_dir={tmp_path}"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "on Flower each SuperNode already trains its own clients" in done.stderr


# -- sweeps on a real Ray cluster (head + worker nodes on 127.0.0.1) ---------------------------------

SWEEP = {"name": "ray", "base": {"rounds": 8, "local_epochs": 2, "clients_per_round": 4, "checkpoint_every": 1,
                                 "partition": {"num_clients": 8}, "model": {"name": "mlp", "hidden": [32]}},
         "methods": ["fedavg", "scaffold"], "seeds": [0, 1]}
RAY_ENV = {**ENV, "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
           "RAY_USAGE_STATS_ENABLED": "0"}


class Node:
    """One Ray node: `ray start --block` in its own session, stopped by killing that session.

    Each node of a test's cluster hands its workers' ports out of its own range: every raylet
    takes them from Ray's one default range (10002-19999), and nodes on one host then gave the
    same port twice (a driver's ``ray.init`` died with "Failed to start the grpc server. The
    specified port is 10002", in 2 of 3 full suites of 2026-11-28)."""

    def __init__(self, args: list[str], tmp: Path):
        self.port = next((a.split("=", 1)[1] for a in args if a.startswith("--port=")), None)
        ray = Path(sys.executable).with_name("ray")
        index = len(list(tmp.glob('ray-*.log')))
        self.log = open(tmp / f"ray-{index}.log", "w")
        first = 10002 + 3000 * index  # (below Linux's ephemeral ports, where free_port's come from)
        ports = [f"--min-worker-port={first}", f"--max-worker-port={first + 2999}"]
        self.proc = subprocess.Popen(
            [str(ray), "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1", *ports, *args],
            env=RAY_ENV,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the node's raylet, workers and agents with it
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=300)
        self.log.close()
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"  # a killed head leaves it behind
        if self.port and current.is_file() and current.read_text().strip().endswith(f":{self.port}"):
            current.unlink()


def wait_for_cpus(address: str, cpus: int, timeout: float = 120) -> None:
    code = (f"import ray, time; ray.init(address='{address}', logging_level='ERROR'); t = time.time()\n"
            f"while sum(n['Resources'].get('CPU', 0) for n in ray.nodes() if n['Alive']) != {cpus}:\n"
            f"    assert time.time() - t < {timeout}; time.sleep(0.5)")
    done = subprocess.run(
        [sys.executable, "-c", code], env=RAY_ENV, capture_output=True, text=True, timeout=timeout + 60
    )
    assert done.returncode == 0, done.stderr[-2000:]


def db_rows(folder: Path) -> tuple[dict, dict]:
    """Every run's status, config and summary, and every round's metrics, without wall-clock times."""
    import sqlite3

    db = sqlite3.connect(folder / "results.sqlite")
    def drop(d):
        return {k: v for k, v in json.loads(d).items() if not k.startswith("time/")}

    runs = {
        r[0]: (r[1], json.loads(r[2]), drop(r[3]))
        for r in db.execute("SELECT run_id, status, config, summary FROM runs")
    }
    rounds = {(r[0], r[1]): drop(r[2]) for r in db.execute("SELECT run_id, round, metrics FROM rounds")}
    db.close()
    return runs, rounds


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The sweep with --jobs 1 (in this process, one torch thread)."""
    pytest.importorskip("ray")
    from fedskew.experiments.sweep import load_spec, run_sweep

    folder = tmp_path_factory.mktemp("jobs1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a Ray task with num_cpus 1 (the thread count moves CPU round-off)
    try:
        run_sweep(load_spec(SWEEP), folder, jobs=1).close()
    finally:
        torch.set_num_threads(threads)
    return db_rows(folder)


def assert_same_db(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    assert got[0].keys() == want[0].keys() and got[1].keys() == want[1].keys()
    for table, rows in enumerate(want):
        for key, row in rows.items():
            if got[table][key] != row:
                a, b = got[table][key], row
                if isinstance(b, tuple):  # (status, config, summary)
                    a, b = {**a[2], "status": a[0], **a[1]}, {**b[2], "status": b[0], **b[1]}
                diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                raise AssertionError(f"{key}: {[(k, a.get(k), b.get(k)) for k in diff][:5]}")


def sweep_cmd(folder: Path, address: str) -> list[str]:
    (folder.parent / "ray.yaml").write_text(json.dumps(SWEEP))
    return [sys.executable, "-m", "fedskew.cli", "sweep", str(folder.parent / "ray.yaml"), "--out", str(folder),
            "--no-report", "--ray", address]


def test_ray_sweep_errors_are_one_sentence(tmp_path):
    (tmp_path / "s.yaml").write_text(json.dumps(SWEEP))
    base = [sys.executable, "-m", "fedskew.cli", "sweep", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "out")]
    done = subprocess.run(base + ["--ray", f"127.0.0.1:{free_port()}"], capture_output=True, text=True, env=ENV,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "fedskew: error: no Ray cluster answers at '127.0.0.1:" in done.stderr
    assert not (tmp_path / "out").exists()  # nothing planned
    done = subprocess.run(base + ["--ray-gpus", "0.5"], capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 2 and "--ray-cpus and --ray-gpus ask Ray for resources; add --ray" in done.stderr


def test_a_sweep_on_a_ray_cluster_gives_the_jobs_1_database(tmp_path, reference):
    port = free_port()
    address = f"127.0.0.1:{port}"
    nodes = [Node(["--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false"], tmp_path)]
    try:
        nodes.append(Node([f"--address={address}", "--num-cpus=1"], tmp_path))
        wait_for_cpus(address, 2)
        done = subprocess.run(sweep_cmd(tmp_path / "sw", address), env=ENV, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "on Ray (127.0.0.1:" in done.stdout and "4 runs, 0 failed" in done.stdout
        assert_same_db(db_rows(tmp_path / "sw"), reference)
    finally:
        for node in reversed(nodes):
            node.kill()


def test_killing_the_worker_node_mid_sweep_loses_nothing(tmp_path, reference):
    """The head offers no CPU, so every run trains on a worker node; node A is killed while a run is
    half done (its metrics file has rounds, its summary not yet), node B joins; Ray resubmits the
    lost task, which resumes the run from its checkpoint: the database equals --jobs 1's."""
    import time

    port = free_port()
    address = f"127.0.0.1:{port}"
    head = Node(["--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false"], tmp_path)
    nodes = [head]
    sweep = None
    try:
        a = Node([f"--address={address}", "--num-cpus=1"], tmp_path)
        nodes.append(a)
        wait_for_cpus(address, 1)
        out = tmp_path / "sw"
        sweep = subprocess.Popen(sweep_cmd(out, address), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
        deadline, half_done = time.time() + 300, None
        while half_done is None:
            assert time.time() < deadline and sweep.poll() is None, "no run got half way"
            for metrics in out.glob("runs/*/metrics.jsonl"):
                lines = metrics.read_text().splitlines()
                if 2 <= len(lines) < SWEEP["base"]["rounds"] and not (metrics.parent / "summary.json").exists():
                    half_done = metrics.parent
            time.sleep(0.05)
        a.kill()
        nodes.append(Node([f"--address={address}", "--num-cpus=1"], tmp_path))
        output, _ = sweep.communicate(timeout=600)
        assert sweep.returncode == 0, output[-3000:]
        assert "4 runs, 0 failed" in output
        assert (half_done / "summary.json").exists()
        assert_same_db(db_rows(out), reference)
    finally:
        if sweep is not None and sweep.poll() is None:
            sweep.kill()
        for node in reversed(nodes):
            node.kill()
