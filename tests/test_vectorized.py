"""The vectorised executor must give the sequential executor's results, same seed, to float tolerance.

Tolerance: 1e-5 absolute on every parameter after 2 rounds. Both executors run the same float32
arithmetic on the same samples in the same order; they differ only in how reductions are grouped
(batched matmuls under vmap vs per-client matmuls), which moves results by a few float32 ulps per
step (measured: at most ~1.2e-7 after 2 rounds). 1e-5 is far below any real divergence (a wrong
batch, a skipped step or a wrong momentum shows up at 1e-3 or more) and above accumulated rounding.

Why momentum 0.5 in the two-round cases: with momentum 0.9 at lr 0.01 on these tiny clients the
training dynamics amplify rounding; perturbing the start of round 2 by 3e-8 moves the sequential
executor's own result by 5.6e-5 (measured), so no executor could match another to 1e-5 there. The
momentum-0.9 case is therefore checked over one round, where both start from the same tensors.
FedMR's intra-class term is checked on a small feature dimension with batches of 32: its per-class
standardisation divides by sqrt(var + 1e-8), which for features with almost no within-class
variance (small classes in a batch, dead ReLUs) multiplies rounding differences by up to 1e4. With
the BatchNorm CNN even mu1 = 1e-5 moves the two executors 1e-2 apart within one round (measured),
while its single-step loss and gradient agree exactly (``tests/test_fedmr.py``), so the BN case
checks the prototype term alone.
FedMMD's bandwidth is the (detached) mean pairwise distance, so its gradient scales as 1 / feature
scale; an untrained projection head has features of size ~0.1 and at lam = 0.1 the MMD term jumps
from 0 to ~5 within three steps on these batches of 7, amplifying rounding to 1e-2 (measured).
The case uses lam = 0.01, where the term stays a term.
"""

import pytest
import torch

from fedskew.config import load_config
from fedskew.engine.runner import Experiment, run
from fedskew.methods import METHODS, Method

# Dirichlet gives clients of unequal sizes; batch 7 gives short last batches at different steps.
BASE = ["rounds=2", "partition=dirichlet", "partition.alpha=0.3", "partition.min_size=5",
        "partition.num_clients=8", "clients_per_round=5", "local_epochs=2", "batch_size=7",
        "momentum=0.5", "final_personalization=false"]
TOL = 1e-5


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Parity holds at a fixed thread count: with 2 intra-op threads the batched and the per-client
    kernels of a BatchNorm CNN sum in different orders, and FedAvg's cnnbn case differs by 1e-4
    after 2 rounds (measured here, also at the commit before issue 17)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def both(tmp_path, extra, expect_fallback=False):
    a = run(load_config(None, BASE + extra + ["executor=sequential"]), tmp_path / "seq")
    vec = Experiment(load_config(None, BASE + extra + ["executor=vectorized"]), tmp_path / "vec")
    b = vec.run()
    if not expect_fallback:  # really vectorised, not the sequential fallback compared with itself
        assert vec.executor.fallback_reason is None, vec.executor.fallback_reason
    return a, b


def assert_same(a, b):
    for k in a.global_state:
        assert torch.allclose(a.global_state[k], b.global_state[k], atol=TOL, rtol=0), k
    for ha, hb in zip(a.history, b.history):
        assert ha["clients"] == hb["clients"]
        assert ha["train/loss"] == pytest.approx(hb["train/loss"], abs=1e-5)
        assert ha["personal/acc_before"] == pytest.approx(hb["personal/acc_before"], abs=1e-9)
        assert ha["personal/acc_after"] == pytest.approx(hb["personal/acc_after"], abs=1e-9)
        assert ha["comm/up_floats"] == hb["comm/up_floats"]


@pytest.mark.parametrize("extra", [
    [],                                                        # FedAvg, MLP
    ["model=cnnbn", "model.width=4"],                          # BatchNorm buffers stacked
    ["grad_clip=0.5", "weight_decay=0.01", "momentum=0.5"],    # clipping, decay, momentum
    ["method.weighting=batches", "max_parallel_clients=2"],    # chunks of 2 clients
    ["momentum=0.9", "rounds=1"],                              # the papers' momentum, one round
    # FedMR: both intra forms, prototypes (round 2 uses round 1's), Lite, partial sharing, BN
    ["method=fedmr", "model.hidden=[32,16]", "batch_size=32", "method.intra_form=paper", "method.mu1=0.001",
     "method.mu2=0.01"],
    ["method=fedmr", "model.hidden=[32,16]", "batch_size=32", "method.intra_form=code", "method.lite_n=8",
     "method.proto_share_fraction=0.5", "method.mu2=0.01", "method.inter_classes=local"],
    ["method=fedmr", "model=cnnbn", "model.width=4", "method.mu1=0", "method.mu2=0.01"],
    ["method.prototypes.mu2=0.01", "method.decorrelation.mu1=0.001", "model.hidden=[32,16]", "batch_size=32"],
    # frozen forwards of other states inside the vmapped loss (global model, per-client previous model)
    ["method=moon", "model=cnnbn", "model.width=4", "rounds=3"],
    ["method=fedmmd", "model.projection_dim=16", "method.lam=0.01"],
    ["method=scaffold", "method.prototypes.mu2=0.01"],
    # step corrections after the optimizer step (controls stacked per client), with decay and clipping
    ["method=scaffold", "weight_decay=0.01", "grad_clip=0.5", "rounds=3"],
    ["method=feddc", "weight_decay=0.01", "rounds=3"],
    # two local stages: RS upload then HPM personalisation (KD teacher = per-client HPM), BN recalibration
    ["method=map", "method.kt_lambda=0.1"],
    ["method=map", "method.kt_lambda=0.1", "method.schedule=paper"],
    ["method=fedphp", "method.kt=mmd", "model=cnnbn", "model.width=4", "method.schedule=code"],
    ["method=scaffold", "method.rs.alpha=0.5", "method.rs.form=soft", "method.hpm.kt_lambda=0.1"],
    # per-round client preparation (anchor sets) and frozen global logits
    ["method=fedka", "method.anchor_strategy=hard", "method.anchor_cap=3"],
    ["method=fedka", "model=cnnbn", "model.width=4", "method.ka_beta=0.1"],  # eval-mode anchors, BN
    ["method=fedntd", "method.ntd_tau=2.0"],
    # personalised baselines: per-stage frozen parameters, personalisation stage first (FedRep),
    # per-client models (Ditto, FedProto), inner torch.func.grad steps with BatchNorm (pFedMe, Per-FedAvg)
    ["method=ditto", "method.lam=0.5"],
    ["method=dittors", "model.classifier_bias=false"],
    ["method=fedrep", "model=cnnbn", "model.width=4"],
    ["method=fedbabu", "method.finetune_fraction=0.5"],
    ["method=fedrod"],
    ["method=fedproto", "rounds=3"],
    ["method=fedlc"],
    ["method=pfedme", "model=cnnbn", "model.width=4", "method.inner_steps=2"],
    ["method=perfedavg", "model=cnnbn", "model.width=4"],
    # crop/flip augmentation drawn per (round, client, stage, position): identical in both executors
    ["method=fedphp", "model=cnnbn", "model.width=4", "dataset.augment=true"],
])
def test_vectorized_matches_sequential(tmp_path, extra):
    assert_same(*both(tmp_path, extra))


def test_unequal_clients_really_are_unequal():
    exp = Experiment(load_config(None, BASE + ["executor=vectorized"]), run_dir=None)
    sizes = {len(exp.fed.train_idx[k]) for k in range(8)}
    assert len(sizes) > 3 and any(n % 7 for n in sizes)


class NotVectorizable(Method):
    name = "not_vectorizable_test"
    vectorizable = False


class DataDependent(Method):
    """A loss with Python control flow on tensor values: cannot run under vmap."""
    name = "data_dependent_test"

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
        return (loss * 2 if loss.item() > 100 else loss), aux


@pytest.mark.parametrize("cls", [NotVectorizable, DataDependent])
def test_fallback_to_sequential_with_a_notice(tmp_path, capsys, monkeypatch, cls):
    monkeypatch.setitem(METHODS, cls.name, cls)
    a, b = both(tmp_path, [f"method={cls.name}"], expect_fallback=True)
    assert "falls back to sequential" in capsys.readouterr().out
    for k in a.global_state:
        assert torch.equal(a.global_state[k], b.global_state[k])


def test_chunk_size_shrinks_under_a_small_memory_budget(monkeypatch):
    import fedskew.engine.vectorized as V

    exp = Experiment(load_config(None, BASE + ["executor=vectorized"]))
    per_client = 4 * sum(p.numel() * 4 for p in exp.model.parameters())
    monkeypatch.setattr(V, "_device_memory", lambda device: 4 * 3 * per_client)
    assert exp.executor.chunk_size(8) == 3
    assert exp.executor.chunk_size(2) == 2
