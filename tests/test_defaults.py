"""The defaults fixed because, as first shipped, they gave a wrong conclusion (issue 17): each test
here fails on the old behaviour. The registry-wide check that every default trains is
tests/test_health.py; FedPHP's and MAP's schedules are replayed in tests/test_map.py, FedDC's
official-code rules in tests/test_baselines.py."""

import math

import pytest
import torch
import torch.nn.functional as F

from fedskew.algorithms import build_method
from fedskew.algorithms.methods.fedadam import FedAdam
from fedskew.algorithms.methods.fedyogi import FedYogi
from fedskew.algorithms.tensors import intra_class_loss
from fedskew.config import load_config
from fedskew.engine.local import load_state
from fedskew.engine.protocol import batch_schedule
from fedskew.engine.runner import Experiment
from fedskew.engine.vectorized import VectorizedExecutor
from fedskew.metrics import live_units

SMALL = ["partition.num_clients=5", "clients_per_round=2", "rounds=1", "local_epochs=2", "batch_size=16",
         "final_personalization=false"]


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_scaffold_correction_is_applied_outside_momentum(tmp_path, executor):
    """With momentum 0.5 and weight decay, SCAFFOLD's local model is torch.optim.SGD on the CE
    alone, followed after every step by p -= lr (c - c_i) (NIID-Bench), replayed by hand; the
    loss-term form (correction through the momentum buffer) gives another model."""
    cfg = load_config(None, SMALL + ["method=scaffold", "momentum=0.5", "weight_decay=1e-3", f"executor={executor}"])
    exp = Experiment(cfg, tmp_path / "probe")
    g = torch.Generator().manual_seed(0)
    start = {k: v.detach().clone() for k, v in exp.model.state_dict().items() if v.is_floating_point()}
    names = exp.info.param_names
    payload = {**{"model." + k: v for k, v in start.items()},
               **{"c." + k: 0.05 * torch.randn(start[k].shape, generator=g) for k in names}}
    k = 1
    state = {"ci." + n: 0.05 * torch.randn(start[n].shape, generator=g) for n in names}
    lr = cfg.lr
    [result] = exp.executor.train_round(0, [k], payload, {k: state}, lr)

    model = exp.model
    load_state(model, start)
    idx = exp.fed.train_idx[k]
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5, weight_decay=1e-3)
    params = dict(model.named_parameters())
    for pos in batch_schedule(exp.executor.settings, 0, k, len(idx)):
        loss = F.cross_entropy(model(exp.fed.data.x_train[idx[pos]]), exp.fed.data.y_train[idx[pos]])
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for n in names:
                params[n] -= lr * (payload["c." + n] - state["ci." + n])
    for n in names:
        assert torch.allclose(result.upload["model." + n], params[n], atol=1e-6), n

    as_loss = Experiment(load_config(None, SMALL + ["method=scaffold", "momentum=0.5", "weight_decay=1e-3",
                                                    "method.correction=loss", f"executor={executor}"]), tmp_path / "l")
    [other] = as_loss.executor.train_round(0, [k], payload, {k: state}, lr)
    gap = max((other.upload["model." + n] - params[n]).abs().max().item() for n in names)
    assert gap > 1e-3


def test_scaffold_and_feddc_controls_are_momentum_aware_by_default():
    """c_i+ divides by FedNova's a(tau, rho): tau at rho = 0 (the paper's plain SGD)."""
    from fedskew.algorithms.drift import control_scale, effective_steps
    from fedskew.algorithms.methods.feddc import FedDCOptions
    from fedskew.algorithms.methods.scaffold import ScaffoldOptions
    assert ScaffoldOptions().control_steps == "momentum" and FedDCOptions().control_steps == "fixed"

    class R:
        num_steps, lr = 20, 0.1
        momentum = 0.9
    assert control_scale(R, "momentum") == pytest.approx(1 / (effective_steps(20, 0.9) * 0.1))
    R.momentum = 0.0
    assert control_scale(R, "momentum") == pytest.approx(1 / (20 * 0.1)) == control_scale(R, "steps")


@pytest.mark.parametrize("cls", [FedAdam, FedYogi])
def test_adaptive_server_first_step_is_bounded_by_server_lr(cls):
    """Reddi et al. with v0 = tau^2: |x1 - x0| <= eta_g (1 - b1) / sqrt(1 - b2) = eta_g per
    coordinate, whatever Delta; the default eta_g is 0.01 (1.0 moved every weight by about 1)."""
    method = cls(cls.Options(), info=type("I", (), {"param_names": ("w",)})())
    assert method.opt.server_lr == 0.01
    x0 = {"w": torch.zeros(5)}
    uploads = [{"model.w": torch.tensor([100.0, -3.0, 1e-6, 0.0, 0.5])}]
    reports = [type("R", (), {"num_samples": 10, "num_steps": 1})()]
    state = method.server_init(x0, method.info)
    new, _ = method.aggregate(state, x0, uploads, reports)
    step = (new["w"] - x0["w"]).abs()
    assert (step <= method.opt.server_lr + 1e-9).all()
    assert step[0] == pytest.approx(method.opt.server_lr, rel=0.01)  # a large Delta: about eta_g * sign


def test_fedmr_default_objective_prefers_live_features_to_dead_ones():
    """At its defaults FedMR's objective CE + mu1 L_intra is lower for features that are alive and
    classify than for dead ReLU units (all zero: chance CE). The literal paper form at the same mu1
    prefers the dead units (that is how it collapsed to chance), so the test can fail."""
    torch.manual_seed(0)
    C, d, b = 3, 200, 16
    y = torch.arange(b) % C
    z_live = torch.relu(torch.randn(b, d) + 2 * F.one_hot(y, C).float().repeat(1, d // C + 1)[:, :d])
    w = torch.zeros(C, d)
    for c in range(C):
        w[c] = z_live[y == c].mean(0) - z_live.mean(0)
    z_dead = torch.zeros(b, d)
    mu1 = build_method(load_config(None, ["method=fedmr"]).method).opt.mu1
    assert mu1 == 0.01

    def objective(z, form):
        return F.cross_entropy(z @ w.T, y) + mu1 * intra_class_loss(z, y, C, form)
    assert live_units(z_live) == d and live_units(z_dead) == 0
    assert objective(z_live, "code") < objective(z_dead, "code")
    assert objective(z_live, "paper") > objective(z_dead, "paper")


def test_live_units_reported_beside_eig_var(tmp_path):
    from fedskew.engine.runner import run
    res = run(load_config(None, SMALL + ["feature_stats=true"]), tmp_path / "r")
    h = res.history[-1]
    assert h["features/dim"] == 200 and 0 < h["features/live_units"] <= 200 and h["features/eig_var_top50"] > 0


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_fedka_anchor_loss_is_zero_where_local_equals_global_with_batchnorm(tmp_path, executor):
    """Anchors padded to anchor_cap go through the local model in eval mode, the mode of the
    global logits: at the first step (local = received global) the anchor loss is exactly 0 with a
    BatchNorm model (in train mode the zero padding shifted it to 0.41)."""
    cfg = load_config(None, SMALL + ["method=fedka", "model=cnnbn", "model.width=4", f"executor={executor}"])
    exp = Experiment(cfg, tmp_path / "ka")
    from fedskew.engine.local import federated_state, module_forward
    glob = federated_state(exp.model)
    payload = exp.method.broadcast(glob, {})
    k = 0
    state = (
        exp.executor.sequential.prepare(0, k, payload, exp.method.client_init(k, glob, exp.info))
        if isinstance(exp.executor, VectorizedExecutor)
        else exp.executor.prepare(0, k, payload, exp.method.client_init(k, glob, exp.info))
    )
    assert 0 < state["ka.valid"].sum() < exp.method.opt.anchor_cap  # real anchors plus padding
    x = exp.fed.data.x_train[exp.fed.train_idx[k][:16]]
    y = exp.fed.data.y_train[exp.fed.train_idx[k][:16]]
    exp.model.train()
    _, aux = exp.method.local_loss(module_forward(exp.model), dict(exp.model.named_parameters()), x, y, payload, state)
    assert aux["fedka/anchor"].item() == 0.0
    assert exp.method.opt.ka_beta == 0.001


def test_fedproto_prototypes_are_the_unweighted_mean_over_holders_by_default():
    from fedskew.algorithms.methods.fedproto import FedProto
    method = FedProto(FedProto.Options())
    prev = torch.full((2, 2), float("nan"))
    uploads = [{"fedproto.mean": torch.tensor([[1.0, 1.0], [0.0, 0.0]]), "fedproto.count": torch.tensor([1.0, 0.0])},
               {"fedproto.mean": torch.tensor([[3.0, 5.0], [2.0, 2.0]]), "fedproto.count": torch.tensor([3.0, 4.0])}]
    _, state = method.aggregate({"fedproto.g": prev}, {}, uploads, [])
    assert torch.equal(state["fedproto.g"], torch.tensor([[2.0, 3.0], [2.0, 2.0]]))
    counted = FedProto(FedProto.Options(proto_weighting="count"))
    _, state = counted.aggregate({"fedproto.g": prev}, {}, uploads, [])
    assert torch.allclose(state["fedproto.g"][0], torch.tensor([2.5, 4.0]))  # (1 * 1 + 3 * 3) / 4, ...


def test_a_method_needing_the_etf_head_gets_it_unless_the_config_says_otherwise():
    assert load_config(None, ["method=etf_gmv"]).model.classifier == "etf"
    assert load_config(None, ["method=fedavg"]).model.classifier == "linear"
    from fedskew.config import ConfigError
    with pytest.raises(ConfigError, match="needs model.classifier = 'etf'"):
        Experiment(load_config(None, ["method=etf_gmv", "model.classifier=linear"]))


def test_scaffold_step_count_helper_agrees_with_fednova():
    from fedskew.algorithms.drift import effective_steps
    assert effective_steps(10, 0.0) == 10
    assert effective_steps(10, 0.5) == pytest.approx((10 - 0.5 * (1 - 0.5 ** 10) / 0.5) / 0.5)
    assert math.isclose(effective_steps(1, 0.9), 1.0)
