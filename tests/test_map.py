"""MAP family: restricted softmax (FedRS), inherited private model (FedPHP), MAP (methods.md s. 2)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedskew.algorithms.tensors import hpm_momentum, kd_loss, mmd2, rs_scales
from fedskew.config import load_config
from fedskew.engine.local import load_state
from fedskew.engine.protocol import LocalSettings, batch_schedule
from fedskew.engine.rundir import read_checkpoint
from fedskew.engine.runner import Experiment, run
from fedskew.metrics import classifier_proxy_stats
from fedskew.models.functional import frozen_fn


def test_rs_scales_hard_and_soft_by_hand():
    counts = torch.tensor([10, 5, 0, 2])
    assert rs_scales(counts, 0.5, "hard").tolist() == [1.0, 1.0, 0.5, 1.0]
    # soft: alpha + (1 - alpha) * n_c / max n = 0.5 + 0.5 * [1, 0.5, 0, 0.2]
    assert rs_scales(counts, 0.5, "soft") == pytest.approx(torch.tensor([1.0, 0.75, 0.5, 0.6]))
    assert rs_scales(counts, 1.0, "hard").tolist() == [1.0] * 4  # alpha = 1: plain softmax


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 1.0])
def test_rs_gradient_of_missing_class_is_alpha_times_plain(alpha):
    """Paper Eq. 9: d CE / d w_c = s_c * (p_c - y_c) * z, p the restricted softmax; for a missing
    class this is alpha times the plain-softmax gradient (p_c - y_c) z at the same probabilities."""
    torch.manual_seed(0)
    z = torch.randn(6, 4)
    y = torch.tensor([0, 1, 3, 0, 1, 3])  # class 2 missing
    w = torch.randn(5, 4, requires_grad=True)  # class 4 missing too
    s = rs_scales(torch.bincount(y, minlength=5), alpha)
    loss = F.cross_entropy((z @ w.T) * s, y)
    (grad,) = torch.autograd.grad(loss, w)
    p = F.softmax((z @ w.T).detach() * s, dim=1)
    plain_at_same_point = (p - F.one_hot(y, 5)).T @ z / len(y)  # gradient of CE w.r.t. a plain row
    for c in (2, 4):
        assert torch.allclose(grad[c], alpha * plain_at_same_point[c], atol=1e-6)
    for c in (0, 1, 3):
        assert torch.allclose(grad[c], plain_at_same_point[c], atol=1e-6)


def test_hpm_momentum_schedule_values():
    # q = 0.2, T = 150: expected visits floor(30) = 30
    assert [round(hpm_momentum(torch.tensor(float(v)), 30.0).item(), 6) for v in (0, 10, 30, 45)] == \
        [0.0, 0.3, 0.9, 0.9]
    # fewer than one expected visit: denominator 1, so any second visit is capped at mu_max
    assert hpm_momentum(torch.tensor(1.0), 0.5, 0.8).item() == pytest.approx(0.8)


def test_kd_value_and_direction_by_hand():
    g = torch.tensor([[1.0, 2.0, 0.5]], requires_grad=True)
    gp = torch.tensor([[3.0, 0.0, 1.0]])
    T = 4.0
    pt = np.exp(gp.numpy()[0] / T) / np.exp(gp.numpy()[0] / T).sum()
    ps = np.exp(g.detach().numpy()[0] / T) / np.exp(g.detach().numpy()[0] / T).sum()
    expected = (pt * np.log(pt / ps)).sum() * T ** 2
    value = kd_loss(g, gp, T)
    assert value.item() == pytest.approx(expected, rel=1e-5)
    (grad,) = torch.autograd.grad(value, g)
    # d/dg KL(pt || softmax(g/T)) T^2 = T (softmax(g/T) - pt): a step against it moves toward the teacher
    assert np.allclose(grad.numpy()[0], T * (ps - pt), atol=1e-6)
    assert kd_loss(gp, gp, T).item() == pytest.approx(0.0, abs=1e-6)
    # reference-code form: cross-entropy from softmax(gp / T) to softmax(g)
    log_s = g.detach().numpy()[0] - np.log(np.exp(g.detach().numpy()[0]).sum())
    assert kd_loss(g, gp, T, "code").item() == pytest.approx(-(pt * log_s).sum(), rel=1e-5)


def test_mmd_on_two_tiny_samples_by_hand():
    x = torch.tensor([[0.0], [1.0]])
    y = torch.tensor([[3.0], [4.0]])
    pts = [0.0, 1.0, 3.0, 4.0]
    d2 = [[(a - b) ** 2 for b in pts] for a in pts]
    b0 = sum(sum(r) for r in d2) / 12  # mean over the 12 distinct pairs
    k = [[sum(math.exp(-d2[i][j] / (s * b0)) for s in (0.25, 0.5, 1, 2, 4)) for j in range(4)] for i in range(4)]
    xx = (k[0][0] + k[0][1] + k[1][0] + k[1][1]) / 4
    yy = (k[2][2] + k[2][3] + k[3][2] + k[3][3]) / 4
    xy = (k[0][2] + k[0][3] + k[1][2] + k[1][3]) / 4
    assert mmd2(x, y).item() == pytest.approx(xx + yy - 2 * xy, rel=1e-6)
    assert mmd2(x, x).item() == pytest.approx(0.0, abs=1e-6)


def test_proxy_stats_by_hand():
    w0 = torch.zeros(3, 2)
    w1 = torch.tensor([[3.0, 4.0], [0.0, 1.0], [0.0, -1.0]])
    s = classifier_proxy_stats(w0, w1, torch.tensor([True, False, False]), lr=0.5)
    assert s["norm_O"] == pytest.approx(5.0) and s["norm_M"] == pytest.approx(1.0)
    assert s["update_O"] == pytest.approx(10.0) and s["update_M"] == pytest.approx(2.0)
    assert s["dist_MM"] == pytest.approx(2.0)
    assert s["dist_OM"] == pytest.approx((math.sqrt(9 + 9) + math.sqrt(9 + 25)) / 2)
    assert "dist_OO" not in s  # a single observed class has no pair


# One client per round on purpose: the new global model is then that client's upload exactly.
ONE = ["partition=pcdd", "partition.classes_per_client=3", "partition.num_clients=5", "clients_per_round=1",
       "rounds=1", "local_epochs=2", "batch_size=16", "momentum=0.5", "model.classifier_bias=false",
       "final_personalization=false"]


def test_map_uploads_the_rs_model_and_keeps_the_personalised_one(tmp_path):
    # paper schedule, E = 2: stage A is exactly the first epoch, so the upload is FedRS with E = 1
    m = Experiment(load_config(None, ONE + ["method=map", "method.alpha=0.3", "method.kt_lambda=0.2",
                                            "method.schedule=paper"]), tmp_path / "map")
    res = m.run()
    rs = run(load_config(None, ONE + ["method=fedrs", "method.alpha=0.3", "local_epochs=1"]), tmp_path / "rs")
    for k in res.global_state:
        assert torch.allclose(res.global_state[k], rs.global_state[k], atol=1e-6), k

    # The kept model: stage B by hand from the upload, on the second epoch's batches, CE + KD from
    # the HPM (= the initial global model on a first visit), and the HPM takes it whole (mu = 0).
    k = res.history[0]["clients"][0]
    states = read_checkpoint(tmp_path / "map" / "checkpoint.pt")["client_states"]
    hpm = {n[len("hpm.model."):]: v for n, v in states[k].items()
           if n.startswith("hpm.model.")}
    init = Experiment(load_config(None, ONE + ["method=map"]), tmp_path / "init").model
    teacher = {n: v.detach().clone() for n, v in init.state_dict().items()}
    model = m.model
    load_state(model, rs.global_state)
    idx = m.fed.train_idx[k]
    batches = batch_schedule(LocalSettings(2, 16, seed=0), 0, k, len(idx))
    steps_per_epoch = math.ceil(len(idx) / 16)
    opt = torch.optim.SGD(model.parameters(), lr=m.cfg.lr, momentum=0.5, weight_decay=m.cfg.weight_decay)
    frozen = frozen_fn(model)
    for pos in batches[steps_per_epoch:]:
        x, y = m.fed.data.x_train[idx[pos]], m.fed.data.y_train[idx[pos]]
        logits = model(x)
        _, teacher_logits = frozen(teacher, x)
        loss = 0.8 * F.cross_entropy(logits, y) + 0.2 * kd_loss(logits, teacher_logits, 4.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for n, v in model.state_dict().items():
        assert torch.allclose(hpm[n], v, atol=1e-6), n
    # and the personalised accuracy reported is that model's on the client's local test split
    # (held out from the client's share of the training split)
    test = m.fed.test_idx[k]
    with torch.no_grad():
        acc = (model(m.fed.data.x_train[test]).argmax(1) == m.fed.data.y_train[test]).float().mean().item()
    assert res.history[0]["personal/acc_after"] == pytest.approx(acc)


def test_code_schedule_steps_and_lr():
    from fedskew.algorithms.components import HPMOptions, InheritedPrivateModel
    paper = InheritedPrivateModel(HPMOptions(schedule="paper"))
    code = InheritedPrivateModel(HPMOptions())  # the default: the MAP authors' code
    assert paper.split_steps(25, 0.1) == (13, 12, 0.1)
    assert code.split_steps(25, 0.5) == (25, 5, 0.1)     # max(ceil(2.5), 5)
    assert code.split_steps(100, 0.5) == (100, 10, 0.1)
    assert InheritedPrivateModel(HPMOptions(schedule="fedphp")).split_steps(25, 0.5) == (25, 0, 0.5)


def _first_hpm(path, k):
    return {n[len("hpm.model."):]: v for n, v in read_checkpoint(path / "checkpoint.pt")["client_states"][k].items()
            if n.startswith("hpm.model.")}


def _replay(exp, k, start, batches, lr, loss_fn):
    """torch.optim.SGD (momentum 0.5, the run's weight decay) from ``start`` on client k's batches."""
    model = exp.model
    load_state(model, start)
    idx = exp.fed.train_idx[k]
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5, weight_decay=exp.cfg.weight_decay)
    for pos in batches:
        x, y = exp.fed.data.x_train[idx[pos]], exp.fed.data.y_train[idx[pos]]
        loss = loss_fn(model(x), x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: v.detach().clone() for n, v in model.state_dict().items()}


def test_map_code_schedule_uploads_all_epochs_and_keeps_a_short_kd_stage(tmp_path):
    """The default (authors' code): the upload is FedRS with all E epochs; the HPM is stage B:
    max(ceil(0.1 S), 5) steps at 0.2 lr from the upload, on the batches that follow, with
    (1 - lambda) CE + lambda KD from the HPM (the initial model on a first visit)."""
    m = Experiment(
        load_config(None, ONE + ["method=map", "method.alpha=0.3", "method.kt_lambda=0.2"]), tmp_path / "map"
    )
    res = m.run()
    rs = run(load_config(None, ONE + ["method=fedrs", "method.alpha=0.3"]), tmp_path / "rs")
    for n in res.global_state:
        assert torch.allclose(res.global_state[n], rs.global_state[n], atol=1e-6), n
    k = res.history[0]["clients"][0]
    idx = m.fed.train_idx[k]
    total = 2 * math.ceil(len(idx) / 16)
    extra = max(math.ceil(0.1 * total), 5)
    batches = batch_schedule(
        LocalSettings(2, 16, seed=0), 0, k, len(idx), 2 + math.ceil(extra / math.ceil(len(idx) / 16))
    )
    teacher = {n: v.detach().clone() for n, v in Experiment(load_config(None, ONE + ["method=map"]),
                                                            tmp_path / "init").model.state_dict().items()}
    frozen = frozen_fn(m.model)
    kept = _replay(m, k, rs.global_state, batches[total:total + extra], 0.2 * m.cfg.lr,
                   lambda logits, x, y: 0.8 * F.cross_entropy(logits, y) + 0.2 * kd_loss(logits, frozen(teacher, x)[1]))
    hpm = _first_hpm(tmp_path / "map", k)
    for n, v in kept.items():
        assert torch.allclose(hpm[n], v, atol=1e-6), n


def test_fedphp_uploads_e_epochs_of_ce_plus_kd_and_the_hpm_takes_it(tmp_path):
    """FedPHP as published: the uploaded model is E epochs of (1 - lambda) CE + lambda KD from the
    HPM (the initial model on a first visit), replayed with torch.optim.SGD; with mu = 0 on a first
    visit the HPM becomes that model; it is the personalised model scored."""
    exp = Experiment(load_config(None, ONE + ["method=fedphp", "method.kt_lambda=0.2"]), tmp_path / "php")
    teacher = {n: v.detach().clone() for n, v in exp.model.state_dict().items()}
    res = exp.run()
    k = res.history[0]["clients"][0]
    idx = exp.fed.train_idx[k]
    frozen = frozen_fn(exp.model)
    upload = _replay(
        exp,
        k,
        teacher,
        batch_schedule(LocalSettings(2, 16, seed=0), 0, k, len(idx)),
        exp.cfg.lr,
        lambda logits, x, y: 0.8 * F.cross_entropy(logits, y) + 0.2 * kd_loss(logits, frozen(teacher, x)[1]),
    )
    hpm = _first_hpm(tmp_path / "php", k)
    for n, v in upload.items():
        assert torch.allclose(res.global_state[n], v, atol=1e-6), n
        assert torch.allclose(hpm[n], v, atol=1e-6), n
    # the old fedskew FedPHP (half the steps plain CE, uploaded) is a different model
    half = run(load_config(None, ONE + ["method=fedphp", "method.kt_lambda=0.2", "method.schedule=paper"]),
               tmp_path / "half")
    assert not torch.allclose(half.global_state["classifier.weight"], upload["classifier.weight"], atol=1e-4)


def test_fedphp_second_visit_mixes_the_hpm_with_momentum():
    """mu_k = 0.9 Q_k / floor(q T): after one earlier visit of 4 expected, 0.225 of the old HPM."""
    from fedskew.algorithms.components import HPMOptions, InheritedPrivateModel
    comp = InheritedPrivateModel(HPMOptions(schedule="fedphp"))
    state = {"hpm.model.w": torch.zeros(3), "hpm.visits": torch.tensor(1.0), "hpm.expected": torch.tensor(4.0)}
    _, new = comp.after_training({"w": torch.ones(3)}, {}, state, report=_Report())
    assert torch.allclose(new["hpm.model.w"], torch.full((3,), 1 - 0.225))
    assert float(new["hpm.visits"]) == 2.0


class _Report:
    recalibrate_bn = None


def test_map_family_defaults_follow_the_paper():
    """alpha 0.9 (MAP paper Sections 5.2.2, 5.2.5), KD with lambda 0.01, a bias-free classifier
    unless the config sets one, MAP on the authors' code schedule, FedPHP one stage."""
    for name in ("fedrs", "map", "dittors"):
        cfg = load_config(None, [f"method={name}"])
        assert cfg.model.classifier_bias is False
        from fedskew.algorithms import build_method
        assert build_method(cfg.method).opt.alpha == 0.9
    assert load_config(None, ["method=map", "model.classifier_bias=true"]).model.classifier_bias is True
    assert load_config(None, ["method=fedavg"]).model.classifier_bias is True
    from fedskew.algorithms.methods.fedphp import FedPHPOptions
    from fedskew.algorithms.methods.map import MAPOptions
    assert MAPOptions().schedule == "code" and FedPHPOptions().schedule == "fedphp"
    assert MAPOptions().kt == "kd" and MAPOptions().kt_lambda == 0.01


def test_hpm_bn_recalibration_matches_a_plain_pass(tmp_path):
    """code schedule with a BN model: the kept HPM's running mean is the mean of per-batch means
    of its inputs, i.e. one cumulative pass over the local data."""
    exp = Experiment(load_config(None, ONE + ["method=map", "method.schedule=code", "model=cnnbn", "model.width=4"]),
                     tmp_path / "bn")
    exp.run()
    (cid, state), = read_checkpoint(tmp_path / "bn" / "checkpoint.pt")["client_states"].items()
    hpm = {n[len("hpm.model."):]: v for n, v in state.items() if n.startswith("hpm.model.")}
    model = exp.model
    load_state(model, hpm)
    x = exp.fed.data.x_train[exp.fed.train_idx[cid]]
    first_bn = next(n for n, mod in model.named_modules() if isinstance(mod, torch.nn.BatchNorm2d))
    seen = []
    hook = dict(model.named_modules())[first_bn].register_forward_hook(
        lambda mod, inp, out: seen.append(inp[0].mean(dim=(0, 2, 3))))
    model.eval()
    with torch.no_grad():
        for i in range(0, len(x), 16):
            model(x[i:i + 16])
    hook.remove()
    # cumulative average over batches (BatchNorm momentum=None): the unweighted mean of batch means
    assert torch.allclose(hpm[f"{first_bn}.running_mean"], torch.stack(seen).mean(0), atol=1e-5)


def test_two_personalisation_stages_are_refused():
    with pytest.raises(ValueError, match="at most one"):
        run(load_config(None, ONE + ["method=map", "method.hpm.kt=mmd"]))


def test_rs_with_alpha_zero_leaves_missing_rows_untouched_end_to_end(tmp_path):
    """Through the whole engine (both executors): with alpha = 0 no gradient reaches a missing
    class's classifier row, so with no weight decay the uploaded row is the received one."""
    for executor in ("sequential", "vectorized"):
        exp = Experiment(load_config(None, ONE + ["method=fedrs", "method.alpha=0", "weight_decay=0",
                                                  f"executor={executor}"]), tmp_path / executor)
        start = {n: v.detach().clone() for n, v in exp.model.named_parameters()}
        res = exp.run()
        k = res.history[0]["clients"][0]
        observed = exp.info.class_counts[k] > 0
        w0, w1 = start["classifier.weight"], res.global_state["classifier.weight"]
        assert torch.equal(w1[~observed], w0[~observed])
        assert (w1[observed] - w0[observed]).abs().amax(dim=1).gt(0).all()  # observed rows train
