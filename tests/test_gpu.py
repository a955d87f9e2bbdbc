"""CUDA correctness (issue 53): what GPU users run by default, checked on a GPU.

Marked ``gpu`` (``python -m pytest -m gpu``, the first step of ``benchmarks/gpu_window.py``) and
skipped where torch sees no CUDA device, as on CI. fp32 throughout, TF32 off and cuDNN
deterministic (the parity the CPU tests hold: tests/test_vectorized.py's module docstring): the
sequential executor, the vectorised one and packed lanes on CUDA agree for methods that cover the
hooks (FedAvg; SCAFFOLD's step correction; FedRS's restricted softmax; FedPHP's second stage;
BatchNorm buffers; pFedFDA's closed-form head; Adam's lanes; dropout masks); bf16 and fp16 runs
finish and learn; a pack that runs out of device memory halves its lanes; a checkpoint written on
CUDA resumes on the CPU, and the reverse, with every tensor carried bit for bit.
"""

import pytest
import torch

import fedskew
from conftest import crash_after
from fedskew.algorithms import METHODS
from fedskew.config import load_config
from fedskew.engine.rundir import read_checkpoint
from fedskew.engine.runner import Experiment, run
from test_lanes import check_out_of_memory_halving, packed_as_alone
from test_vectorized import BASE, assert_parity, base_for

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the gpu marker's tests)")]

CUDA = ["device=cuda"]
CASES = {  # id -> the case's keys (with BASE); each exercises one part of the method interface on the device
    "fedavg": [],
    "scaffold": ["method=scaffold"],
    "fedrs": ["method=fedrs"],
    "fedphp": ["method=fedphp"],
    "cnnbn": ["model=cnnbn", "model.width=4"],
    # (round 2 is a knife edge here: tests/test_vectorized.py, REGISTRY_OPTIONS)
    "pfedfda": ["method=pfedfda", "rounds=1"],
    "adam": ["optimizer=adam", "lr=0.001"],
    "dropout": ["model.dropout=0.3"],
}


@pytest.fixture(autouse=True)
def exact_cuda():
    """fp32 as written: no TF32 in matmuls or convolutions, deterministic cuDNN kernels."""
    before = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.deterministic,
    )
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    yield
    (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
     torch.backends.cudnn.deterministic) = before


@pytest.mark.parametrize("case", list(CASES))
def test_sequential_vectorised_and_packed_agree_on_cuda(tmp_path, case):
    extra = CASES[case] + CUDA
    seq = run(load_config(None, base_for(extra) + extra + ["executor=sequential"]), tmp_path / "seq")
    vec = Experiment(load_config(None, base_for(extra) + extra + ["executor=vectorized"]), tmp_path / "vec")
    got = vec.run()
    assert vec.executor.fallback_reason is None, vec.executor.fallback_reason
    on = next(vec.model.parameters()).device  # the result's state lives where its model does (rundir.RunResult)
    assert on.type == "cuda" and all(v.device == on for v in got.global_state.values())
    assert_parity(tmp_path, extra + ["executor=vectorized"], seq, got)
    packed_as_alone(tmp_path / "packed", extra)  # two runs (another seed, lr and float options) as lanes


TINY = ["rounds=2", "executor=vectorized", "partition.num_clients=6", "clients_per_round=3", "model.hidden=[32]",
        "local_epochs=1"]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_runs_on_cuda_as_on_the_cpu(tmp_path, name):
    """Every registered method, two rounds and its final personalisation on CUDA (the vectorised
    executor, what GPU users run): it finishes with a finite loss and the CPU run's records (the
    clients, the floats sent), and its accuracies are the CPU run's to a few test samples (fp32
    round-off on two devices; the parity cases above hold exact ones). Only 8 methods had run on a
    GPU before this test, and the first window found pFedFDA building its head across two devices."""
    cpu = run(load_config(None, [f"method={name}", *TINY]), tmp_path / "cpu")
    gpu = run(load_config(None, [f"method={name}", *TINY, *CUDA]), tmp_path / "cuda")
    for hc, hg in zip(cpu.history, gpu.history, strict=True):
        assert torch.isfinite(torch.tensor(hg["train/loss"])), hg["train/loss"]
        assert hc["clients"] == hg["clients"] and hc["comm/up_floats"] == hg["comm/up_floats"]
        for key in ("global/test_acc", "personal/acc_after"):
            assert (hc[key] is None) == (hg[key] is None), key
            assert hc[key] is None or abs(hc[key] - hg[key]) <= 0.05, (key, hc[key], hg[key])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_mixed_precision_runs_finish_and_learn_on_cuda(tmp_path, precision, executor):
    res = run(load_config(None, BASE + CUDA + ["model=cnnbn", "model.width=4", "rounds=4", f"precision={precision}",
                                               f"executor={executor}"]), tmp_path / "run")
    losses = [h["train/loss"] for h in res.history]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert res.history[-1]["global/test_acc"] > 0.15  # above chance (10 classes)


def test_a_pack_out_of_memory_on_cuda_halves_its_lanes(tmp_path, monkeypatch, capsys):
    """tests/test_lanes.py's check (the first merged call of more than 5 lanes raises
    torch.OutOfMemoryError), with the CUDA caching allocator in the loop."""
    check_out_of_memory_halving(tmp_path, monkeypatch, capsys, CUDA)


@pytest.mark.parametrize("first,then", [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_checkpoint_moves_between_cuda_and_the_cpu(tmp_path, first, then):
    """Written on one device, resumed on the other: the state it resumes from is the checkpoint's to
    the bit (read on both devices), the rounds before it stay as they were, the run finishes on the
    other device, and two resumes of copies of the same checkpoint agree exactly."""
    import shutil

    cfg = {"rounds": 4, "partition.num_clients": 6, "clients_per_round": 3, "local_epochs": 1, "model.hidden": [16],
           "method": "map", "final_personalization": False}
    with pytest.raises(KeyboardInterrupt):
        fedskew.run({**cfg, "device": first}, out_dir=str(tmp_path), run_name="r", on_round=crash_after(1))
    shutil.copytree(tmp_path / "r", tmp_path / "copy")
    on_cpu, on_gpu = (
        read_checkpoint(tmp_path / "r" / "checkpoint.pt"),
        read_checkpoint(tmp_path / "r" / "checkpoint.pt", "cuda"),
    )
    for k, v in on_cpu["global_state"].items():
        assert torch.equal(v, on_gpu["global_state"][k].cpu()), k
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    a = fedskew.resume(tmp_path / "r", device=then)
    b = fedskew.resume(tmp_path / "copy", device=then)
    assert (tmp_path / "r" / "metrics.jsonl").read_text().startswith(before)
    assert len(a.history) == 4 and all(torch.equal(a.global_state[k], b.global_state[k]) for k in a.global_state)


@pytest.mark.parametrize("case", ["fedavg", "cnnbn"])
def test_the_compiled_step_matches_the_eager_one_on_cuda(tmp_path, case):
    """``compile=on``: the stacked loss through torch.compile with CUDA graphs (``reduce-overhead``)
    trains what the eager vectorised step trains (issue 53, item 2); the window's speed step says
    whether it pays. Last in this file: its compilation is the slowest part of the window's test
    step, whose limit would otherwise cut the tests after it."""
    extra = CASES[case] + CUDA
    eager = run(load_config(None, base_for(extra) + extra + ["executor=vectorized"]), tmp_path / "eager")
    vec = Experiment(load_config(None, base_for(extra) + extra + ["executor=vectorized", "compile=on"]),
                     tmp_path / "compiled")
    got = vec.run()
    assert vec.executor.fallback_reason is None, vec.executor.fallback_reason
    assert_parity(tmp_path, extra + ["executor=vectorized"], eager, got)
