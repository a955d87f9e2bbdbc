"""Personalised baselines (MAP paper Table II): each checked on a piece that can be worked by hand
or replayed with plain torch.optim.SGD on the same batches."""

import math

import pytest
import torch
import torch.nn.functional as F

from fedskew.algorithms.methods.fedlc import calibrated_loss
from fedskew.algorithms.methods.fedproto import nearest_prototype_head, prototype_regularizer
from fedskew.algorithms.methods.pfedme import moreau_solve
from fedskew.algorithms.tensors import balanced_softmax_loss
from fedskew.config import ConfigError, load_config
from fedskew.engine.local import federated_state, load_state, module_forward
from fedskew.engine.protocol import stage_schedules
from fedskew.engine.rundir import read_checkpoint
from fedskew.engine.runner import Experiment

# One client of 3 classes, one round, E = 2 epochs of batch 16, momentum 0.5.
ONE = ["partition=pcdd", "partition.classes_per_client=3", "partition.num_clients=5", "clients_per_round=1",
       "rounds=1", "local_epochs=2", "batch_size=16", "momentum=0.5", "final_personalization=false"]


def one_round(tmp_path, extra, name="run"):
    exp = Experiment(load_config(None, ONE + extra), tmp_path / name)
    init = federated_state(exp.model)
    res = exp.run()
    k = res.history[0]["clients"][0]
    state = read_checkpoint(tmp_path / name / "checkpoint.pt")["client_states"][k]
    return exp, init, res, k, state


def stages(exp, k):
    """The client's (upload batches, personal batches, personal lr) of round 0."""
    return stage_schedules(exp.executor.settings, exp.method, 0, k, len(exp.fed.train_idx[k]), exp.cfg.lr)


def replay(exp, k, start, batches, lr, loss_fn, trainable=None):
    """SGD (the run's momentum) on ``batches`` of client k from ``start``, updating ``trainable``
    parameters only; returns the model state."""
    model = exp.model
    load_state(model, start)
    model.train()
    params = [p for n, p in model.named_parameters() if trainable is None or trainable(n)]
    opt = torch.optim.SGD(params, lr=lr, momentum=exp.cfg.momentum)
    idx = exp.fed.train_idx[k]
    for pos in batches:
        x, y = exp.fed.data.x_train[idx[pos]], exp.fed.data.y_train[idx[pos]]
        loss = loss_fn(model, x, y)
        model.zero_grad()
        loss.backward()
        opt.step()
    return federated_state(model)


def ce(model, x, y):
    return F.cross_entropy(model(x), y)


def is_head(name):
    return name.startswith("classifier.")


def close(a, b, keys=None, atol=1e-6):
    for key in keys or a:
        assert torch.allclose(a[key], b[key], atol=atol), key


def own(state, prefix):
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def local_test_acc(exp, k, state):
    test = exp.fed.test_idx[k]
    load_state(exp.model, state)
    exp.model.eval()
    with torch.no_grad():
        return (exp.model(exp.fed.data.x_train[test]).argmax(1) == exp.fed.data.y_train[test]).float().mean().item()


# -- FedRep ----------------------------------------------------------------------------------------


def test_fedrep_trains_head_then_body_and_averages_only_the_body(tmp_path):
    exp, init, res, k, state = one_round(tmp_path, ["method=fedrep", "method.head_fraction=0.25"])
    body_batches, head_batches, lr = stages(exp, k)
    total = len(body_batches) + len(head_batches)
    assert len(head_batches) == round(0.25 * total) and len(body_batches) == total - len(head_batches)
    # head epochs first, body frozen, from the received body + own head (= the initial model)
    after_head = replay(exp, k, init, head_batches, lr, ce, is_head)
    close(after_head, init, [n for n in init if not is_head(n)], atol=0)  # body untouched
    # then the body, head frozen
    after_body = replay(exp, k, after_head, body_batches, exp.cfg.lr, ce, lambda n: not is_head(n))
    close(after_body, after_head, [n for n in init if is_head(n)], atol=0)  # head untouched
    close(own(state, "rep."), after_head, [n for n in init if is_head(n)])  # the client keeps its head
    # the server averages the body only (one client: its body) and never has a trained head
    close(res.global_state, after_body, [n for n in init if not is_head(n)])
    close(res.global_state, init, [n for n in init if is_head(n)], atol=0)
    body_floats = sum(v.numel() for n, v in init.items() if not is_head(n))
    assert res.history[0]["comm/up_floats"] == body_floats == res.history[0]["comm/down_floats"]
    # no global model: reported as none; the personalised model is the new body + own head
    assert res.summary["global/test_acc"] is None and res.history[0]["global/test_acc"] is None
    assert res.history[0]["personal/acc_after"] == pytest.approx(local_test_acc(exp, k, after_body))


# -- FedBABU ---------------------------------------------------------------------------------------


def test_fedbabu_never_trains_the_head_and_fine_tunes_the_received_model(tmp_path):
    exp, init, res, k, state = one_round(tmp_path, ["method=fedbabu", "method.finetune_fraction=0.5"])
    body_batches, tune_batches, lr = stages(exp, k)
    trained = replay(exp, k, init, body_batches, exp.cfg.lr, ce, lambda n: not is_head(n))
    close(res.global_state, trained)  # body trained, head still the random initial one
    close(res.global_state, init, [n for n in init if is_head(n)], atol=0)
    assert res.history[0]["comm/up_floats"] == sum(v.numel() for n, v in init.items() if not is_head(n))
    # personalised: the received global model (here the initial one), all of it fine-tuned
    assert len(tune_batches) == math.ceil(0.5 * len(body_batches))
    tuned = replay(exp, k, init, tune_batches, lr, ce)
    close(own(state, "babu."), tuned)
    assert res.history[0]["personal/acc_after"] == pytest.approx(local_test_acc(exp, k, tuned))


# -- Ditto -----------------------------------------------------------------------------------------


def test_ditto_personal_model_follows_its_proximal_update(tmp_path):
    lam = 0.5
    exp, init, res, k, state = one_round(tmp_path, ["method=ditto", f"method.lam={lam}"])
    global_batches, personal_batches, lr = stages(exp, k)
    # the global update is FedAvg's
    close(res.global_state, replay(exp, k, init, global_batches, exp.cfg.lr, ce))
    # v starts from the client's v (first visit: the initial model) and is pulled to the received w
    w = {n: v.clone() for n, v in init.items()}

    def ditto_loss(model, x, y):
        prox = sum((p - w[n]).pow(2).sum() for n, p in model.named_parameters())
        return F.cross_entropy(model(x), y) + 0.5 * lam * prox

    v = replay(exp, k, init, personal_batches, lr, ditto_loss)
    close(own(state, "ditto."), v)
    assert res.history[0]["personal/acc_after"] == pytest.approx(local_test_acc(exp, k, v))


def test_dittors_restricts_only_the_global_update(tmp_path):
    exp, init, res, k, state = one_round(tmp_path, ["method=dittors", "method.alpha=0", "weight_decay=0",
                                                    "model.classifier_bias=false"])
    observed = exp.info.class_counts[k] > 0
    w0, w1 = init["classifier.weight"], res.global_state["classifier.weight"]
    assert torch.equal(w1[~observed], w0[~observed])  # alpha = 0: missing rows of the upload frozen
    v = own(state, "ditto.")["classifier.weight"]
    assert (v[~observed] - w0[~observed]).abs().amax() > 0  # the personal model trains plain softmax


# -- FedROD ----------------------------------------------------------------------------------------


def test_balanced_softmax_by_hand():
    logits = torch.tensor([[1.0, 2.0, 0.0]])
    counts = torch.tensor([4.0, 1.0, 0.0])
    adjusted = torch.tensor([1.0 + math.log(4), 2.0, 0.0 + math.log(1e-12)])
    hand = -(adjusted[0] - torch.logsumexp(adjusted, 0))
    assert balanced_softmax_loss(logits, torch.tensor([0]), counts).item() == pytest.approx(hand.item(), rel=1e-6)


def test_fedrod_personal_prediction_adds_both_heads(tmp_path):
    exp, init, res, k, state = one_round(tmp_path, ["method=fedrod"])
    batches, personal_batches, lr = stages(exp, k)
    counts = exp.info.class_counts[k].float()
    generic = replay(exp, k, init, batches, exp.cfg.lr, lambda m, x, y: balanced_softmax_loss(m(x), y, counts))
    close(res.global_state, generic)
    # the personal head W_p: CE of the summed logits, body and generic head fixed, from W_p = 0
    wp = {n: torch.zeros_like(v) for n, v in generic.items() if is_head(n)}
    model = exp.model
    load_state(model, generic)
    opt = torch.optim.SGD(wp.values(), lr=lr, momentum=exp.cfg.momentum)
    for t in wp.values():
        t.requires_grad_(True)
    idx = exp.fed.train_idx[k]
    for pos in personal_batches:
        x, y = exp.fed.data.x_train[idx[pos]], exp.fed.data.y_train[idx[pos]]
        with torch.no_grad():
            z, logits_g = model(x, return_features=True)
        loss = F.cross_entropy(logits_g + F.linear(z, wp["classifier.weight"], wp.get("classifier.bias")), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    close(own(state, "rod.p."), {n: v.detach() for n, v in wp.items()}, atol=1e-5)
    # the personalised model's logits are the sum of both heads' on the generic features
    personal = exp.method.personal_state(generic, state)
    x = exp.fed.data.x_train[:5]
    load_state(model, generic)
    model.eval()
    with torch.no_grad():
        z, logits_g = model(x, return_features=True)
        load_state(model, personal)
        summed = logits_g + F.linear(z, state["rod.p.classifier.weight"], state["rod.p.classifier.bias"])
        assert torch.allclose(model(x), summed, atol=1e-5)
    assert res.history[0]["personal/acc_after"] == pytest.approx(local_test_acc(exp, k, personal))


# -- FedProto --------------------------------------------------------------------------------------


def test_nearest_prototype_head_picks_the_nearest_known_prototype():
    torch.manual_seed(0)
    g = torch.randn(6, 5)
    g[3] = float("nan")  # no prototype yet
    w, b = nearest_prototype_head(g)
    z = torch.randn(200, 5)
    dist = torch.cdist(z, torch.nan_to_num(g, nan=1e6))
    assert torch.equal((z @ w.T + b).argmax(1), dist.argmin(1))
    assert not ((z @ w.T + b).argmax(1) == 3).any()


def test_prototype_regularizer_by_hand():
    z = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 1.0]])
    y = torch.tensor([0, 1, 2])
    g = torch.tensor([[0.0, 2.0], [1.0, 1.0], [float("nan"), float("nan")]])
    # squared distances 1 and 2, third sample has no prototype (0); mean over 3 samples x 2 dims
    assert prototype_regularizer(z, y, g).item() == pytest.approx((1 + 2) / 6)


def test_fedproto_shares_only_prototypes_and_predicts_by_the_nearest(tmp_path):
    exp, init, res, k, state = one_round(tmp_path, ["method=fedproto", "rounds=2", "clients_per_round=2"])
    C, d = exp.fed.num_classes, exp.model.feature_dim
    for h in res.history:
        assert h["comm/down_floats"] == 2 * C * d and h["comm/up_floats"] == 2 * (C * d + C)
        assert h["global/test_acc"] is None
    assert res.summary["global/test_acc"] is None and res.summary["comm/extra_pct"] is None
    # The personalised accuracy of the last round's clients, by hand: nearest prototype among
    # those each received (round 0's aggregate), its own for classes still without one.
    ckpt = read_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert ckpt["server_state"]["fedproto.g"].shape == (C, d)
    accs = []
    for k in res.history[-1]["clients"]:
        load_state(exp.model, own(ckpt["client_states"][k], "fedproto.model."))
        exp.model.eval()
        test = exp.fed.test_idx[k]
        with torch.no_grad():
            z, _ = exp.model(exp.fed.data.x_train[test], return_features=True)
        protos = ckpt["client_states"][k]["fedproto.predict"]
        dist = torch.cdist(z, torch.nan_to_num(protos))
        dist[:, torch.isnan(protos[:, 0])] = float("inf")
        accs.append((dist.argmin(1) == exp.fed.data.y_train[test]).float().mean().item())
    assert res.history[-1]["personal/acc_after"] == pytest.approx(sum(accs) / len(accs))


def test_fedproto_needs_a_classifier_bias():
    with pytest.raises(ValueError, match="classifier_bias"):
        Experiment(load_config(None, ONE + ["method=fedproto", "model.classifier_bias=false"]))


def test_head_methods_refuse_the_fixed_etf_head():
    with pytest.raises(ConfigError, match="model.classifier = 'linear'"):
        Experiment(load_config(None, ONE + ["method=fedrep", "model.classifier=etf", "model.hidden=[32,16]"]))


# -- FedLC -----------------------------------------------------------------------------------------


def test_fedlc_calibration_by_hand():
    logits = torch.tensor([[1.0, 2.0, 0.0]])
    counts = torch.tensor([16.0, 1.0, 0.0])
    tau = 2.0
    calibrated = torch.tensor([1.0 - tau * 0.5, 2.0 - tau * 1.0, 0.0 - tau * 1e3])  # 16^(-1/4) = 0.5
    for y in (0, 1):
        hand = -(calibrated[y] - torch.logsumexp(calibrated, 0))
        assert calibrated_loss(logits, torch.tensor([y]), counts, tau).item() == pytest.approx(hand.item(), rel=1e-6)


# -- pFedMe and Per-FedAvg -------------------------------------------------------------------------


def tiny_model(tmp_path, extra=()):
    exp = Experiment(load_config(None, ONE + ["model.hidden=[8]", *extra]), tmp_path / "tiny")
    x, y = exp.fed.data.x_train[:12], exp.fed.data.y_train[:12]
    return exp, x, y


def test_pfedme_local_step_is_lambda_times_w_minus_theta(tmp_path):
    exp, x, y = tiny_model(tmp_path, ["method=pfedme"])
    model, lam, plr, K = exp.model, 15.0, 0.01, 5
    w = {n: p.detach().clone() for n, p in model.named_parameters()}
    # theta by hand: K steps of CE(theta) + lam/2 ||theta - w||^2 from w
    theta = {n: v.clone() for n, v in w.items()}
    for _ in range(K):
        th = {n: v.clone().requires_grad_(True) for n, v in theta.items()}
        loss = F.cross_entropy(torch.func.functional_call(model, th, (x,)), y)
        grads = torch.autograd.grad(loss, list(th.values()))
        theta = {n: theta[n] - plr * (g + lam * (theta[n] - w[n])) for n, g in zip(th, grads)}
    fwd = module_forward(model)
    solved, _ = moreau_solve(fwd, dict(model.named_parameters()), x, y, lam, plr, K)
    close(solved, theta, atol=1e-6)
    params = dict(model.named_parameters())
    loss, _ = exp.method.local_loss(fwd, params, x, y, {}, {})
    grads = torch.autograd.grad(loss, list(params.values()))
    for (n, _p), g in zip(params.items(), grads):
        assert torch.allclose(g, lam * (w[n] - theta[n]), atol=1e-5), n


def test_pfedme_server_mixes_with_beta(tmp_path):
    exp, _, _ = tiny_model(tmp_path, ["method=pfedme", "method.beta=2.0"])
    old = {"a": torch.tensor([1.0])}
    uploads = [{"model.a": torch.tensor([2.0])}, {"model.a": torch.tensor([4.0])}]
    from fedskew.algorithms.base import ClientReport
    reports = [ClientReport(0, 10, 1), ClientReport(1, 10, 1)]
    new, _ = exp.method.aggregate({}, old, uploads, reports)
    assert new["a"].item() == pytest.approx((1 - 2.0) * 1 + 2.0 * 3.0)


def test_perfedavg_gradient_is_the_first_order_maml_gradient(tmp_path):
    alpha = 0.05
    exp, x, y = tiny_model(tmp_path, ["method=perfedavg", f"method.alpha={alpha}"])
    model = exp.model
    params = dict(model.named_parameters())
    loss, _ = exp.method.local_loss(module_forward(model), params, x, y, {}, {})
    grads = torch.autograd.grad(loss, list(params.values()))
    # by hand: temp = w - alpha grad CE(w; first half); gradient = grad CE(temp; second half)
    w = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    g1 = torch.autograd.grad(F.cross_entropy(torch.func.functional_call(model, w, (x[:6],)), y[:6]), list(w.values()))
    temp = {n: (w[n] - alpha * g).detach().requires_grad_(True) for n, g in zip(w, g1)}
    outer = F.cross_entropy(torch.func.functional_call(model, temp, (x[6:],)), y[6:])
    g2 = torch.autograd.grad(outer, list(temp.values()))
    assert loss.item() == pytest.approx(outer.item(), rel=1e-6)
    for g, h in zip(grads, g2):
        assert torch.allclose(g, h, atol=1e-6)


def test_perfedavg_personal_model_adapts_the_received_model(tmp_path):
    exp, init, res, k, state = one_round(tmp_path, ["method=perfedavg", "method.alpha=0.02",
                                                    "method.personal_steps=2"])
    _, personal_batches, lr = stages(exp, k)
    assert len(personal_batches) == 2 and lr == 0.02
    close(own(state, "perfedavg."), replay(exp, k, init, personal_batches, lr, ce))


# -- FedGH (issue 48) --------------------------------------------------------------------------------


def test_fedgh_server_step_is_sgd_on_a_linear_head_over_the_prototypes():
    from fedskew.algorithms.methods.fedgh import train_head

    g = torch.Generator().manual_seed(0)
    protos, labels = torch.randn(7, 5, generator=g), torch.tensor([0, 2, 1, 2, 0, 1, 2])
    w0, b0 = torch.randn(3, 5, generator=g), torch.randn(3, generator=g)
    order = torch.randperm(7, generator=g)
    w, b = train_head(w0, b0, protos, labels, 0.3, 3, order)
    head = torch.nn.Linear(5, 3)
    head.weight.data, head.bias.data = w0.clone(), b0.clone()
    opt = torch.optim.SGD(head.parameters(), lr=0.3)
    for idx in (order[:3], order[3:6], order[6:]):  # batches of 3, the last one smaller
        opt.zero_grad()
        F.cross_entropy(head(protos[idx]), labels[idx]).backward()
        opt.step()
    assert torch.allclose(w, head.weight.detach(), atol=1e-6) and torch.allclose(b, head.bias.detach(), atol=1e-6)
    assert not torch.equal(w, w0)


def test_fedgh_round_trains_own_models_from_the_global_head_and_the_head_on_their_prototypes(tmp_path, monkeypatch):
    """Two rounds, two clients each: round 2 starts each client from its own kept model with the
    head the server trained in round 1; the uploads are the class means of the trained model's
    eval-mode features over the client's data; the new head is train_head over them in the seeded
    order."""
    from fedskew.algorithms.methods.fedgh import train_head
    from fedskew.algorithms.tensors import class_feature_means
    from fedskew.models.functional import frozen_fn
    from fedskew.streams import torch_seed

    cfg = load_config(None, ONE + ["method=fedgh", "rounds=2", "clients_per_round=2", "partition.num_clients=4"])
    exp = Experiment(cfg, tmp_path / "r")
    seen = []
    aggregate = exp.method.aggregate
    monkeypatch.setattr(exp.method, "aggregate", lambda s, g, u, r: seen.append((g, u, r)) or aggregate(s, g, u, r))
    res = exp.run()
    ckpt = read_checkpoint(tmp_path / "r" / "checkpoint.pt")
    for t, (glob, uploads, _reports) in enumerate(seen):
        protos = torch.cat([u["fedgh.mean"][u["fedgh.count"] > 0] for u in uploads])
        labels = torch.cat([torch.nonzero(u["fedgh.count"] > 0).flatten() for u in uploads])
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(torch_seed(0, "fedgh_order", t)))
        w, b = train_head(glob["classifier.weight"], glob["classifier.bias"], protos, labels, 1.0, 16, order)
        after = seen[t + 1][0] if t + 1 < len(seen) else res.global_state
        assert torch.allclose(after["classifier.weight"], w, atol=1e-6) and torch.allclose(after["classifier.bias"], b)
    for u, r in zip(seen[1][1], seen[1][2]):  # round 2's uploads: the kept models' class means
        k = r.client_id
        idx = exp.fed.train_idx[k]
        z, _ = frozen_fn(exp.model)(own(ckpt["client_states"][k], "fedgh.model."), exp.fed.data.x_train[idx])
        means, counts = class_feature_means(z, exp.fed.data.y_train[idx], exp.fed.num_classes)
        assert torch.allclose(u["fedgh.mean"], means, atol=1e-5) and torch.equal(u["fedgh.count"], counts)
    assert res.history[-1]["global/test_acc"] is None
    # a round starts from the client's own kept model with the global head
    kept = ckpt["client_states"][seen[1][2][0].client_id]
    start = exp.method.local_start(exp.method.broadcast(res.global_state, {}), kept)
    assert torch.equal(start["classifier.weight"], res.global_state["classifier.weight"])
    assert all(torch.equal(v, kept["fedgh.model." + k]) for k, v in start.items() if not k.startswith("classifier."))


def knn_reference(z, keys, labels, valid, k, weight, scale, logits, mix):
    """kNN-Per's interpolation by brute force in numpy: the k nearest filled rows by squared L2
    distance, weights exp(-d / (dim scale)), the label distribution, mixed with the model."""
    import numpy as np

    z, keys, labels, logits = (t.double().numpy() for t in (z, keys, labels, logits))
    rows = np.flatnonzero(valid.numpy() > 0)
    out = []
    for i in range(len(z)):
        d = ((keys[rows] - z[i]) ** 2).sum(1)
        near = rows[np.argsort(d, kind="stable")[:k]]
        w = np.exp(-((keys[near] - z[i]) ** 2).sum(1) / (z.shape[1] * scale))
        p = (w[:, None] * labels[near]).sum(0) / (w.sum() + 1e-9)
        if mix == "probabilities":
            e = np.exp(logits[i] - logits[i].max())
            out.append(np.log(weight * p + (1 - weight) * e / e.sum() + 1e-12))
        else:
            out.append(weight * p + (1 - weight) * logits[i])
    return np.array(out)


@pytest.mark.parametrize("mix", ["probabilities", "logits"])
def test_knnper_interpolation_equals_a_brute_force_knn(mix):
    import numpy as np

    from fedskew.models.nets import KNNNet, SkewNet

    torch.manual_seed(0)
    base = SkewNet(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()), 3, 5)
    net = KNNNet(base, capacity=8, k=3, weight=0.4, scale=2.0, mix=mix).eval()
    x = torch.randn(6, 4)
    z, plain = base(x, return_features=True)
    torch.testing.assert_close(net(x), plain)  # an empty datastore: the model alone
    net.knn.keys[:5] = torch.randn(5, 3)  # five of eight rows filled
    net.knn.labels[torch.arange(5), torch.tensor([0, 1, 1, 4, 2])] = 1
    net.knn.valid[:5] = 1
    want = knn_reference(z.detach(), net.knn.keys, net.knn.labels, net.knn.valid, 3, 0.4, 2.0, plain.detach(), mix)
    np.testing.assert_allclose(net(x).detach().double().numpy(), want, rtol=1e-5, atol=1e-6)


def test_knnper_trains_fedavg_and_personalises_with_its_own_features(tmp_path):
    from fedskew.algorithms.base import ClientData
    from fedskew.engine.runner import run
    from fedskew.models.functional import frozen_fn

    args = ["rounds=3", "partition.num_clients=6", "clients_per_round=3", "final_personalization=true"]
    avg = run(load_config(None, args), tmp_path / "avg")
    knn = Experiment(load_config(None, args + ["method=knnper", "method.capacity=40"]), tmp_path / "knn")
    res = knn.run()
    for k, v in avg.global_state.items():  # the global model is FedAvg's, the datastore stays empty
        torch.testing.assert_close(res.global_state[k], v)
    assert float(res.global_state["knn.valid"].sum()) == 0
    # a client's datastore: 40 of its samples (a seeded draw) under the model it received
    method, fed = knn.method, knn.fed
    client = max(range(6), key=lambda c: len(fed.train_idx[c]))
    x, y = fed.data.x_train[fed.train_idx[client]], fed.data.y_train[fed.train_idx[client]]
    assert len(y) > 40
    frozen = frozen_fn(knn.model)
    data = ClientData(client, 0, x, y, frozen)
    payload = {"model." + k: v for k, v in res.global_state.items()}
    state = method.prepare(payload, {}, data)
    assert int(state["knn.valid"].sum()) == 40
    z, _ = frozen(res.global_state, x)
    rows = [int(torch.nonzero((z - key).abs().sum(1) < 1e-5)[0]) for key in state["knn.keys"]]
    assert len(set(rows)) == 40  # distinct samples, each stored with its own label
    assert all(state["knn.labels"][i].argmax() == y[r] for i, r in enumerate(rows))
    assert res.summary["personal/final_acc_before"] > avg.summary["personal/final_acc_before"] + 0.1


def test_floco_draws_its_point_from_the_client_stream():
    """Training: alpha from 2M + 1 uniform draws of the stream, on the simplex before projection
    (normalised exponentials), in the L1 ball of radius rho after; evaluation: the centre."""
    from fedskew.models.nets import DROPOUT_MASKS, GeneratorMasks, SimplexLinear

    head = SimplexLinear(torch.randn(3, 4, 5), torch.zeros(4)).train()
    z = torch.randn(6, 5)
    for projected in (0.0, 1.0):
        head.projected.fill_(projected)
        head.center.copy_(torch.tensor([0.5, 0.3, 0.2]))
        head.radius.fill_(0.1 * projected)
        token = DROPOUT_MASKS.set(GeneratorMasks(torch.Generator().manual_seed(7)))
        try:
            alpha = head.alpha(z)
        finally:
            DROPOUT_MASKS.reset(token)
        u = torch.rand((6, 7), generator=torch.Generator().manual_seed(7))[0]  # the same draws, row 0
        if projected:
            v = 2 * u[3:6] - 1
            want = head.center + u[6] * 0.1 * v / v.abs().sum()
        else:
            e = -torch.log(1 - u[:3])
            want = e / e.sum()
        torch.testing.assert_close(alpha, want)
    head.eval()
    torch.testing.assert_close(head(z), z @ torch.einsum("m,mcd->cd", head.center, head.endpoints).T)


def fl_bench_project_clients(stats, endpoints):
    """FL-bench's ``project_clients`` transcribed (its PCA with svd_solver='full')."""
    import numpy as np
    from sklearn import decomposition

    kappas = decomposition.PCA(n_components=endpoints, svd_solver="full").fit_transform(stats)
    lowest, best = np.inf, None
    for z in np.linspace(1e-4, 1, 1000):
        srt = np.sort(kappas, axis=1)[:, ::-1]
        cssv = np.cumsum(srt, axis=1) - np.ones(len(kappas))[:, None] * z
        ind = np.arange(kappas.shape[1]) + 1
        nonzero = np.count_nonzero(srt - cssv / ind > 0, axis=1)
        betas = np.maximum(kappas - (cssv[np.arange(len(kappas)), nonzero - 1] / nonzero)[:, None], 0)
        betas /= betas.sum(axis=1, keepdims=True)
        diff = betas[:, None] - betas[None, :]
        distance = np.sqrt((diff ** 2).sum(axis=2))
        np.fill_diagonal(distance, np.inf)
        distance[distance < 1e-4] = 1e-4
        mutual = distance[np.triu_indices(len(betas), 1)]
        energy = -np.log(len(mutual)) + np.log((1 / mutual ** 2).sum())
        if energy not in [-np.inf, np.inf] and energy < lowest:
            lowest, best = energy, betas
    return best


def test_floco_projection_equals_fl_benchs_and_lands_on_the_simplex():
    import numpy as np

    from fedskew.algorithms.methods.floco import project_clients, simplex_projection

    # a point already on the simplex of size 1 is its own projection; (1, 0.4, 0.2) moves down by
    # theta = (1 + 0.4 - 1) / 2 = 0.2 on its two largest entries, the third clipped at 0
    np.testing.assert_allclose(simplex_projection(np.array([[0.5, 0.2, 0.3], [1.0, 0.4, 0.2]]), 1.0),
                               [[0.5, 0.2, 0.3], [0.8, 0.2, 0.0]], atol=1e-12)
    stats = np.random.default_rng(0).normal(size=(9, 40))
    betas = project_clients(stats, 4)
    np.testing.assert_allclose(betas, fl_bench_project_clients(stats, 4), atol=1e-12)
    assert np.all(betas >= 0) and np.allclose(betas.sum(1), 1)


def test_floco_projects_the_clients_after_tau_rounds_and_personalises_at_their_points(tmp_path):
    exp = Experiment(load_config(None, ["method=floco", "method.tau=2", "method.endpoints=3", "rounds=3",
                                        "partition.num_clients=6", "clients_per_round=6"]), tmp_path / "floco")
    res = exp.run()
    server = read_checkpoint(tmp_path / "floco" / "checkpoint.pt")["server_state"]
    centers = server["floco.center"]
    assert bool(server["floco.on"].all()) and torch.allclose(centers.sum(1), torch.ones(6, dtype=centers.dtype))
    assert (centers >= 0).all() and (centers.max(0).values - centers.min(0).values).max() > 0.1  # spread apart
    # the global model stays at the simplex's centre; a client's personalised model sits at its own point
    assert torch.allclose(res.global_state["classifier.center"], torch.full((3,), 1 / 3))
    personal = exp.method.personal_state(res.global_state, {"floco.center": centers[2], "floco.on": torch.tensor(1.0)})
    assert torch.equal(personal["classifier.center"], centers[2]) and float(
        personal["classifier.radius"]
    ) == pytest.approx(0.1)
