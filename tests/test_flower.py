"""fedskew on Flower: real SuperLink and SuperNode processes talking over HTTP on 127.0.0.1, and
Flower's simulation runtime, against ``fedskew run`` on the same config and seed.

Tolerance: the ClientApp trains with the same ``train_client`` on the same batches and the server
aggregates with the same ``Method.aggregate`` in the same client order, so the numbers agree
exactly here; the assertions allow 1e-6 (float32 round-off, should the tensor transport ever
reorder an operation)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

# real SuperLink, SuperNode and ServerApp processes: left out of README's fast subset; one worker runs every test of the
# group
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("processes")]

pytest.importorskip("flwr")

from fedskew.config import load_config  # noqa: E402
from fedskew.engine.runner import run  # noqa: E402
from fedskew.flower.federation import LocalFederation  # noqa: E402

BASE = ["partition.num_clients=2", "partition.classes_per_client=5", "clients_per_round=2", "rounds=2",
        "final_personalization=false", "model.hidden=[32]"]
TOL = 1e-6


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def assert_same_run(local_dir, flower_dir):
    a, b = records(local_dir), records(flower_dir)
    assert len(a) == len(b) > 0
    for ra, rb in zip(a, b):
        assert ra["clients"] == rb["clients"] and rb["clients_failed"] == []
        for key in ("global/test_acc", "train/loss", "personal/acc_before", "personal/acc_after"):
            assert rb[key] == pytest.approx(ra[key], abs=TOL), key
        assert ra["comm/up_floats"] == rb["comm/up_floats"] and ra["comm/down_floats"] == rb["comm/down_floats"]


def alive(pids):
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().split()[2] != "Z":  # a zombie has exited
                    out.append(pid)
        except (OSError, IndexError):
            pass
    return out


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    fed = LocalFederation(2, tmp_path_factory.mktemp("flower"))
    started = []
    try:
        fed.start()
        yield fed
        started = fed.pids()
    finally:
        fed.stop()
    time.sleep(0.5)
    assert alive(started) == []  # SuperLink, SuperNodes, SuperExecs, ClientApps, workers: all stopped


@pytest.mark.parametrize("extra", [[], ["method=scaffold"], ["method=pfedhn"]], ids=["fedavg", "scaffold", "pfedhn"])
def test_deployment_matches_fedskew_run(federation, tmp_path, extra):
    """FedAvg, SCAFFOLD (server control variate in the payload, client control variate kept
    in Flower's per-node state across rounds) and pFedHN (each client's generated model in its
    own ``download`` record, through the torch-free ClientApp to its worker), on a real SuperLink
    and two SuperNodes."""
    cfg = load_config(None, BASE + extra)
    run(cfg, tmp_path / "local")
    proc = federation.run(cfg, tmp_path / "flower", timeout=120)
    assert proc.returncode == 0 and (tmp_path / "flower" / "summary.json").is_file(), \
        (federation.workdir / "flwr-run.log").read_text()[-3000:]
    assert_same_run(tmp_path / "local", tmp_path / "flower")


def test_a_killed_supernode_leaves_the_round_to_the_others(tmp_path):
    """SuperNode 1 is killed once round 0 is recorded: round 1 waits out the ServerApp's reply
    timeout (20 s; a warm node's reply of BASE's round comes in a few seconds, under load too) for
    it, then aggregates node 0 alone, reporting node 1 as failed; the run ends.
    (BASE's two rounds: each round after the kill waits the whole timeout, which a third round
    only repeated.)"""
    cfg = load_config(None, BASE)
    with LocalFederation(2, tmp_path / "fed") as fed:
        proc = fed.run(cfg, tmp_path / "flower", timeout=20, wait=False)
        deadline = time.time() + 180
        while time.time() < deadline and not ((tmp_path / "flower" / "metrics.jsonl").is_file() and
                                               records(tmp_path / "flower")):
            assert proc.poll() is None, (fed.workdir / "flwr-run.log").read_text()[-3000:]
            time.sleep(0.2)
        fed.kill_node(1)
        proc.wait(timeout=300)
        pids = fed.pids()
    time.sleep(0.5)
    assert alive(pids) == []
    recs = records(tmp_path / "flower")
    assert [r["round"] for r in recs] == [0, 1] and (tmp_path / "flower" / "summary.json").is_file()
    assert recs[0]["clients_failed"] == []
    for r in recs[1:]:  # client 1 is gone: reported, the round aggregates client 0 alone
        assert [f["client"] for f in r["clients_failed"]] == [1]
        assert r["comm/up_floats"] == recs[0]["comm/up_floats"] // 2
        assert r["global/test_acc"] is not None


@pytest.fixture(scope="module")
def one_ray_instance():
    """One Ray instance for the module's simulations. Flower's simulation starts Ray and shuts it
    down on every call (about 6 s of a 20 s case on a quiet machine, more on a busy one); here Ray
    is started once, with the arguments Flower's Ray backend would pass (no dashboard; fedskew is
    installed, so its actors import it without the backend's PYTHONPATH), and the backend's
    ``ray.shutdown`` does nothing until the module's simulations are done. Each call still starts
    and terminates its own actors."""
    ray = pytest.importorskip("ray")
    # one CPU: one actor a simulation, which serves both clients in turn (an actor is a Python process that
    # imports Ray, Flower, torch and fedskew, about 3 s of CPU; the suite's other worker has the second core);
    # log_to_driver off: the actors' lines would land in pytest's output
    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ray, "shutdown", lambda *args, **kwargs: None)
            yield
    finally:
        ray.shutdown()


@pytest.mark.parametrize("extra", [["method=map", "model.classifier_bias=false"], ["method=local"],
                                   ["method=fedadagrad"], ["method=fedasam", "method.disco.disco_a=1.0"],
                                   ["method=fedconcat", "method.clusters=2", "method.encoder_rounds=1"],
                                   ["method=feddbe"], ["method=gpfl"], ["method=fedcp"], ["method=fedas"],
                                   ["method=fedfomo", "method.M=1"], ["method=pfedhn"], ["method=fedamp"],
                                   ["method=fedpac"],
                                   ["method=fedfed", "rounds=3", "method.distill_rounds=1", "method.vae_width=4"]],
                         ids=["map", "local", "fedadagrad", "fedasam+disco", "fedconcat", "feddbe", "gpfl", "fedcp",
                              "fedas", "fedfomo", "pfedhn", "fedamp", "fedpac", "fedfed"])
def test_simulation_runtime_matches_fedskew_run(tmp_path, extra, one_ray_instance):
    """MAP; Local (nothing is sent either way); FedAdagrad (server state m, v); FedASAM's two
    passes in the ClientApp with FedDisco's weights on the server; FedConcat's two phases (the
    second's step budget, Method.local_steps, in the ClientApp); FedDBE (a kept PRBM, the global
    mean sent from round 1); GPFL (a kept head and conditional inputs); FedCP (a kept head and
    context, Gumbel noise in training and evaluation: the same numbers, since every executor seeds
    torch's generator per client); FedAS (the alignment before training, the Fisher trace of the
    client's data after it, in the ClientApp); and the methods whose server sends each client its
    own download (``Method.download``, a ``download`` record in the message): FedFOMO's chosen
    models, pFedHN's generated models, FedAMP's cloud models, FedPAC's combined heads, FedFed's
    shared samples (after its VAE rounds and the upload of the shared features)."""
    from fedskew.flower.app import simulate

    cfg = load_config(None, BASE + extra)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the simulation's Ray actors run (the thread count moves FedFed's conv round-off)
    try:
        run(cfg, tmp_path / "local")
    finally:
        torch.set_num_threads(threads)
    simulate(cfg, tmp_path / "flower")
    assert_same_run(tmp_path / "local", tmp_path / "flower")


def test_core_works_without_flwr(tmp_path):
    """flwr is an optional extra: with it unimportable the core runs, and the Flower command says
    how to install it in one sentence."""
    code = f"""
import sys
sys.modules["flwr"] = None
from fedskew.cli import main
from fedskew.config import load_config
from fedskew.engine.runner import run
res = run(load_config(None, ["rounds=1", "final_personalization=false"]), {str(tmp_path / 'core')!r})
assert res.summary["global/test_acc"] > 0
assert "flwr" not in [m for m in sys.modules if sys.modules[m] is not None]
sys.exit(main(["flower", "simulate", "rounds=1"]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "pip install fedskew[flower]" in done.stderr


def test_a_deep_worker_folder_still_gives_a_socket_the_os_accepts(tmp_path, monkeypatch):
    """AF_UNIX paths hold 107 bytes: a deep FEDSKEW_WORKER_DIR (a pytest worker's tmp path under
    xdist made the killed-node test's socket 108 bytes, and the worker never started) puts the
    socket in a short folder; the key, config and PID files stay in the worker folder."""
    from multiprocessing.connection import Client, Listener

    from fedskew.flower.client import SOCKET_PATH_MAX, worker_paths

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    monkeypatch.setenv("FEDSKEW_WORKER_DIR", str(deep))
    sock, key, cfg = worker_paths('{"x": 1}', 3)
    assert key.parent == deep and cfg.parent == deep and sock.parent != deep
    assert len(os.fsencode(sock)) + 4 <= SOCKET_PATH_MAX and sock.name.endswith(key.stem + ".sock")
    assert worker_paths('{"x": 1}', 3)[0] == sock != worker_paths('{"x": 2}', 3)[0]  # one per config
    with Listener(str(sock), family="AF_UNIX", authkey=b"k") as listener:  # bound: the OS takes the path
        sent = threading.Thread(target=lambda: Client(str(sock), family="AF_UNIX", authkey=b"k").send("hello"))
        sent.start()
        with listener.accept() as conn:
            assert conn.recv() == "hello"
        sent.join()
    shallow = Path(tempfile.mkdtemp(prefix="w"))  # (tmp_path itself may be deep)
    monkeypatch.setenv("FEDSKEW_WORKER_DIR", str(shallow))
    try:
        assert worker_paths('{"x": 1}', 3)[0].parent == shallow
    finally:
        shutil.rmtree(shallow)
