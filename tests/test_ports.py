"""Methods checked against a float64 port of their authors' code (or of the code behind the numbers
they are compared with): the port is written here from the official code, at the commit the method's
``Source`` names, with nothing of fedskew in it. Each method's pure pieces must match the port to
round-off in float64; whole rounds, on both executors, must match a replay whose client is plain
``torch.optim.SGD`` on an ``nn.Module`` and whose server is the port."""

import os

import pytest
import torch
import torch.nn.functional as F

from fedskew.config import load_config
from fedskew.engine.local import federated_state, load_state
from fedskew.engine.protocol import stage_schedules
from fedskew.engine.rundir import read_checkpoint
from fedskew.engine.runner import Experiment

# three rounds of two clients of five, 3 classes each, E = 1, batch 16, momentum 0.5 (a method that weighs
# its clients as FedAvg does runs with method.weighting=uniform, as the official code averages)
BASE = ["partition=pcdd", "partition.classes_per_client=3", "partition.num_clients=5", "clients_per_round=2",
        "rounds=3", "local_epochs=1", "batch_size=16", "momentum=0.5", "final_personalization=false"]
EXECUTORS = ["sequential", "vectorized"]


def rand_state(like: dict, gen: torch.Generator, scale: float = 0.1) -> dict:
    return {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) * scale for k, v in like.items()}


def train(exp, k, start, rnd, loss_fn):
    """Client k's local training of round ``rnd`` replayed on the nn.Module: torch.optim.SGD (the
    run's lr, momentum and weight decay; the run's gradient norm clip) on ``loss_fn(model, x, y)`` over the
    batches the run drew."""
    batches, _, _ = stage_schedules(exp.executor.settings, exp.method, rnd, k, len(exp.fed.train_idx[k]), exp.cfg.lr)
    model = exp.model
    load_state(model, start)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=exp.cfg.lr, momentum=exp.cfg.momentum,
                          weight_decay=exp.cfg.weight_decay)
    idx = exp.fed.train_idx[k]
    for pos in batches:
        loss = loss_fn(model, exp.fed.data.x_train[idx[pos]], exp.fed.data.y_train[idx[pos]])
        model.zero_grad()
        loss.backward()
        if exp.cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), exp.cfg.grad_clip)
        opt.step()
    return federated_state(model)


@torch.no_grad()
def train_loss(exp, k, state) -> torch.Tensor:
    """The mean cross-entropy of ``state`` over client k's whole training split, eval mode."""
    load_state(exp.model, state)
    exp.model.eval()
    idx = exp.fed.train_idx[k]
    return F.cross_entropy(exp.model(exp.fed.data.x_train[idx]), exp.fed.data.y_train[idx])


def ce(model, x, y):
    return F.cross_entropy(model(x), y)


def run(tmp_path, executor, opts):
    exp = Experiment(load_config(None, BASE + opts + [f"executor={executor}"]), tmp_path / executor)
    init = federated_state(exp.model)
    res = exp.run()
    return exp, init, res, read_checkpoint(tmp_path / executor / "checkpoint.pt")


def assert_close(ours: dict, port: dict, atol: float):
    worst = max((ours[k].double() - port[k].double()).abs().max().item() for k in port)
    if os.environ.get("FEDSKEW_PORT_DIFFS"):  # the worst differences, for the methods' pages
        with open(os.environ["FEDSKEW_PORT_DIFFS"], "a") as out:
            out.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]} {worst:.3g}\n")
    assert worst <= atol, worst


# -- FedACG (geehokim/FedACG at 62b6e95) --------------------------------------------------------------------


def fedacg_port_server(w: dict, m: dict, clients: list[dict], lam: float) -> tuple[dict, dict]:
    """servers/base.py ServerM with FedACG: True: the lookahead w + lam m was sent; the new model is the
    plain mean of the client models, the momentum lam m + the mean of (client - lookahead)."""
    look = {k: w[k] + lam * m[k] for k in w}
    mean = {k: sum(c[k] for c in clients) / len(clients) for k in w}
    return mean, {k: lam * m[k] + sum(c[k] - look[k] for c in clients) / len(clients) for k in m}


def fedacg_port_loss(model, x, y, anchor: dict, beta: float):
    """clients/base_client.py _algorithm: CE + prox_loss.weight * sum of ||p - anchor||^2 (no 1/2)."""
    prox = sum(((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters())
    return F.cross_entropy(model(x), y) + beta * prox


def test_fedacg_server_step_matches_the_port_in_float64():
    from fedskew.algorithms.methods.fedacg import server_step

    gen = torch.Generator().manual_seed(0)
    like = {"a": torch.zeros(4, 3), "b": torch.zeros(3)}
    w, m = rand_state(like, gen), rand_state(like, gen)
    clients = [rand_state(like, gen) for _ in range(3)]
    mean = {k: sum(c[k] for c in clients) / 3 for k in like}
    ours_w, ours_m = server_step(w, m, mean, 0.85)
    port_w, port_m = fedacg_port_server(w, m, clients, 0.85)
    assert_close(ours_w, port_w, 1e-15)
    assert_close(ours_m, port_m, 1e-15)
    assert_close({k: w[k] + ours_m[k] for k in w}, ours_w, 1e-15)  # w^{t+1} = w^t + m^{t+1}


@pytest.mark.parametrize("executor", EXECUTORS)
def test_fedacg_rounds_equal_the_official_client_and_server(tmp_path, executor):
    lam, beta = 0.85, 0.01
    exp, init, res, ck = run(tmp_path, executor, ["method=fedacg", f"method.lam={lam}", f"method.beta={beta}",
                                                    "method.weighting=uniform"])
    names = exp.info.param_names
    w, m = dict(init), {k: torch.zeros_like(init[k]) for k in names}
    for rnd, h in enumerate(res.history):
        look = {k: w[k] + lam * m[k] if k in m else w[k] for k in w}
        trained = [train(exp, k, look, rnd, lambda mod, x, y, look=look: fedacg_port_loss(mod, x, y, look, beta))
                   for k in h["clients"]]
        w, m = fedacg_port_server(w, m, trained, lam)
    assert_close(ck["global_state"], w, 1e-5)
    assert_close({k[len("acg.m."):]: v for k, v in ck["server_state"].items()}, m, 1e-5)
    assert max(v.abs().max().item() for v in m.values()) > 1e-3  # the momentum moved


# -- q-FedAvg (litian96/fair_flearn at f097971) -------------------------------------------------------------


def qffl_port(w: dict, clients: list[dict], losses: list[float], lr: float, q: float) -> dict:
    """flearn/trainers/qffedavg.py (train) and fedbase.aggregate2, over numpy arrays there: grads =
    (w - w_k) / lr; Deltas = (F+1e-10)^q grads; hs = q (F+1e-10)^(q-1) norm_grad(grads) + (1/lr)
    (F+1e-10)^q, norm_grad the squared norm of all arrays concatenated; w - sum Deltas / sum hs."""
    deltas, hs = [], []
    for c, loss in zip(clients, losses):
        grads = {k: (w[k] - c[k]) * 1.0 / lr for k in w}
        flat = torch.cat([g.flatten() for g in grads.values()])
        hs.append(q * (loss + 1e-10) ** (q - 1) * float(flat @ flat) + (1.0 / lr) * (loss + 1e-10) ** q)
        deltas.append({k: (loss + 1e-10) ** q * g for k, g in grads.items()})
    return {k: w[k] - sum(d[k] for d in deltas) / sum(hs) for k in w}


@pytest.mark.parametrize("q", [0.0, 0.1, 5.0])
def test_qfedavg_server_step_matches_the_port_in_float64(q):
    from fedskew.algorithms.methods.qfedavg import qffl_step

    gen = torch.Generator().manual_seed(1)
    like = {"a": torch.zeros(4, 3), "b": torch.zeros(3)}
    w = rand_state(like, gen)
    clients = [rand_state(like, gen) for _ in range(4)]
    losses = [0.3, 1.2, 2.5, 0.01]
    ours = qffl_step(w, clients, losses, [0.05] * 4, q, list(like))
    assert_close(ours, qffl_port(w, clients, losses, 0.05, q), 1e-14)
    if q == 0:  # q = 0: the plain mean of the clients' models
        assert_close(ours, {k: sum(c[k] for c in clients) / 4 for k in like}, 1e-14)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("momentum", [0.0, 0.5])  # 0: the official setting, L = 1 / lr
def test_qfedavg_rounds_equal_the_official_client_and_server(tmp_path, executor, momentum):
    q = 2.0
    exp, init, res, ck = run(tmp_path, executor, ["method=qfedavg", f"method.q={q}", f"momentum={momentum}"])
    w = {k: v.double() for k, v in init.items()}
    for rnd, h in enumerate(res.history):
        start = {k: v.float() for k, v in w.items()}
        losses = [float(train_loss(exp, k, start)) for k in h["clients"]]  # F_k before training
        trained = [{k: v.double() for k, v in train(exp, k, start, rnd, ce).items()} for k in h["clients"]]
        w = qffl_port(w, trained, losses, exp.cfg.lr / (1 - momentum), q)  # fedskew's L: 1 / the step size
    assert_close(ck["global_state"], w, 1e-5)
    fedavg = {k: sum(t[k] for t in trained) / len(trained) for k in w}  # the last round: not the mean
    assert max((w[k] - fedavg[k]).abs().max().item() for k in w) > 1e-3


# -- IFCA (jichan3751/ifca at 61e44b8) -----------------------------------------------------------------------


def ifca_port_assign(losses: torch.Tensor) -> int:
    """The trainers' np.argmin over the k cluster losses: the first of equal minima."""
    return int(losses.double().numpy().argmin())


def ifca_port_average(models: list[dict], trained: list[dict], assign: list[int]) -> list[dict]:
    """The mnist/cifar trainers' weight averaging: each cluster's model the plain mean of its members'
    trained models; a cluster nobody chose keeps its model."""
    out = []
    for j, model in enumerate(models):
        members = [t for t, a in zip(trained, assign) if a == j]
        out.append({k: sum(t[k] for t in members) / len(members) for k in model} if members else dict(model))
    return out


def test_ifca_cluster_choice_breaks_ties_as_numpy():
    from fedskew.algorithms.methods.ifca import chosen_model

    for losses in ([1.0, 1.0, 2.0], [3.0, 0.5, 0.5], [0.2, 0.1, 0.3]):
        t = torch.tensor(losses)
        assert int(torch.argmin(t)) == ifca_port_assign(t)
    stacked = {"w": torch.randn(3, 2, 2, dtype=torch.float64)}
    for j in range(3):  # the one-hot pick is the model itself, bit for bit
        assert torch.equal(chosen_model(stacked, F.one_hot(torch.tensor(j), 3).double())["w"], stacked["w"][j])


@pytest.mark.parametrize("executor", EXECUTORS)
def test_ifca_rounds_equal_the_official_client_and_server(tmp_path, executor):
    exp, init, res, ck = run(tmp_path, executor, ["method=ifca", "method.clusters=3", "rounds=4",
                                                 "clients_per_round=3", "method.weighting=uniform"])
    models = [dict(init)] + [exp.info.model_draw(j) for j in (1, 2)]
    assert all((models[1][k] - init[k]).abs().max() > 1e-3 for k in exp.info.param_names)  # independent draws
    chosen = set()
    for rnd, h in enumerate(res.history):
        assign = [ifca_port_assign(torch.stack([train_loss(exp, k, m) for m in models])) for k in h["clients"]]
        chosen |= set(assign)
        trained = [train(exp, k, models[a], rnd, ce)
                   for k, a in zip(h["clients"], assign)]
        models = ifca_port_average(models, trained, assign)
    assert len(chosen) >= 2  # more than one cluster trained
    for j, model in enumerate(models):
        assert_close({k: v[j] for k, v in ((k[len("ifca.models."):], v) for k, v in ck["server_state"].items())},
                     model, 1e-5)


# -- FedDistill / FD (TsingZ0/PFLlib at d832e76, clientfd.py and serverfd.py) ------------------------------

FD_FORMS = {"logits_ce": "pfllib_head", "softmax_ce": "pfllib_softmax", "mse": "pfllib_mse"}


def fd_port_loss(output, y, global_logits: dict | None, lam: float, variant: str):
    """clientFD.train's loss: CE, plus lam * the distance to the server's logits of each label (the
    sample's own logits, detached, where the server has none); CE only before any logits arrive."""
    loss = F.cross_entropy(output, y)
    if global_logits is None:
        return loss
    target = output.detach().clone()
    for b, c in enumerate(y.tolist()):
        if c in global_logits:
            target[b] = global_logits[c]
    if variant == "pfllib_head":  # nn.CrossEntropyLoss with the raw logits as probabilities
        kd = -(target * F.log_softmax(output, 1)).sum(1).mean()
    elif variant == "pfllib_softmax":
        kd = -(target.softmax(1) * F.log_softmax(output, 1)).sum(1).mean()
    else:
        kd = F.mse_loss(target, output)
    return loss + lam * kd


def fd_port_aggregate(uploaded: list[dict]) -> dict:
    """serverFD.proto_aggregation: per class, the plain mean over the uploads that hold it."""
    out = {}
    for d in uploaded:
        for c, v in d.items():
            out.setdefault(c, []).append(v)
    return {c: torch.stack(vs).mean(0) for c, vs in out.items()}


def as_table(logits: dict, num_classes: int) -> torch.Tensor:
    table = torch.full((num_classes, num_classes), float("nan"), dtype=torch.float64)
    for c, v in logits.items():
        table[c] = v
    return table


@pytest.mark.parametrize("form", list(FD_FORMS))
def test_feddistill_loss_matches_the_port_in_float64(form):
    from fedskew.algorithms.methods.feddistill import distillation_term

    gen = torch.Generator().manual_seed(2)
    z = torch.randn(9, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 3])
    g = {0: torch.randn(4, generator=gen, dtype=torch.float64), 2: torch.randn(4, generator=gen, dtype=torch.float64)}
    ours = F.cross_entropy(z, y) + 0.7 * distillation_term(z, y, as_table(g, 4), form)
    port = fd_port_loss(z, y, g, 0.7, FD_FORMS[form])
    assert abs(ours.item() - port.item()) < 1e-14
    (ga,), (gb,) = torch.autograd.grad(ours, [z]), torch.autograd.grad(port, [z])
    assert (ga - gb).abs().max().item() < 1e-15
    if form != "logits_ce":  # a label without server logits distils towards itself: no gradient beyond CE's
        (gc,) = torch.autograd.grad(F.cross_entropy(z, y), [z])
        assert (ga - gc)[y % 2 == 1].abs().max().item() < 1e-15


def test_feddistill_server_logits_match_the_port():
    from fedskew.algorithms.methods.feddistill import class_logits

    gen = torch.Generator().manual_seed(3)
    def draw():
        return torch.randn(3, generator=gen, dtype=torch.float64)

    ups = [{0: draw(), 2: draw()}, {0: draw()}]
    means = [torch.nan_to_num(as_table(u, 3)) for u in ups]
    counts = [torch.tensor([5.0, 0.0, 2.0], dtype=torch.float64), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)]
    ours = class_logits(means, counts, 3)
    port = as_table(fd_port_aggregate(ups), 3)
    assert torch.equal(torch.isnan(ours), torch.isnan(port))  # class 1: nobody's, NaN
    assert (torch.nan_to_num(ours) - torch.nan_to_num(port)).abs().max().item() < 1e-15


@pytest.mark.parametrize("executor", EXECUTORS)
def test_feddistill_rounds_equal_the_pfllib_client_and_server(tmp_path, executor):
    """Every client trains its own model from the same start; the server's table is rebuilt each round.
    The upload is each class's mean logits of the trained model (eval mode), fedskew's documented
    difference from PFLlib's means over the forward passes of training."""
    lam = 0.5
    exp, init, res, ck = run(tmp_path, executor, ["method=feddistill", f"method.lam={lam}", "rounds=3"])
    own, table = {}, None
    for rnd, h in enumerate(res.history):
        ups = []
        for k in h["clients"]:
            g = None if table is None else {c: v.float() for c, v in table.items()}
            own[k] = train(exp, k, own.get(k, init), rnd,
                           lambda m, x, y, g=g: fd_port_loss(m(x), y, g, lam, "pfllib_softmax"))
            load_state(exp.model, own[k])
            exp.model.eval()
            idx = exp.fed.train_idx[k]
            with torch.no_grad():
                logits = exp.model(exp.fed.data.x_train[idx]).double()
            ys = exp.fed.data.y_train[idx]
            ups.append({int(c): logits[ys == c].mean(0) for c in ys.unique()})
        table = fd_port_aggregate(ups)
    got = ck["server_state"]["fd.g"].double()
    assert_close({"g": torch.nan_to_num(got, nan=7.0)}, {"g": torch.nan_to_num(as_table(table, 10), nan=7.0)}, 1e-5)
    for k, state in own.items():
        assert_close({n[len("fd.model."):]: v for n, v in ck["client_states"][k].items()}, state, 1e-5)


# -- FedSOL (Lee-Gihun/FedSOL at ebc3f64, algorithms/fedsol_adaptive/ClientTrainer.py) ----------------------


def fedsol_port_train(exp, k, start, rnd, rho, adaptive, temperature=3.0, floor=1e-6):
    """ClientTrainer.train with ExpSAM (adaptive) or SAM (fixed) around torch.optim.SGD: per batch the KL
    of the received model's softmax(f / T) to the local one's (batchmean) at w, its gradient's
    direction scaled to rho (ExpSAM: times F.normalize(|w - w_g|, dim=0) per tensor), the CE's gradient
    at w + eps, w restored, the SGD step (the run's lr, momentum and weight decay). ``floor``: fedskew's
    one difference, eps = 0 where the KL's gradient is round-off (0: the official code's)."""
    from torch.func import functional_call

    batches, _, _ = stage_schedules(exp.executor.settings, exp.method, rnd, k, len(exp.fed.train_idx[k]), exp.cfg.lr)
    model = exp.model
    load_state(model, start)
    glob = {n: v.clone() for n, v in start.items()}
    opt = torch.optim.SGD(model.parameters(), lr=exp.cfg.lr, momentum=exp.cfg.momentum,
                          weight_decay=exp.cfg.weight_decay)
    idx = exp.fed.train_idx[k]
    for pos in batches:
        x, y = exp.fed.data.x_train[idx[pos]], exp.fed.data.y_train[idx[pos]]
        model.eval()
        with torch.no_grad():
            q = F.softmax(functional_call(model, glob, (x,)) / temperature, 1)
        model.train()
        kl = F.kl_div(F.log_softmax(model(x) / temperature, 1), q, reduction="batchmean")
        params = dict(model.named_parameters())
        g = dict(zip(params, torch.autograd.grad(kl, list(params.values()))))
        norm = torch.sqrt(sum((v ** 2).sum() for v in g.values()))
        scale = rho / (norm + 1e-12) if norm >= floor else 0.0  # floor: fedskew's, below which g is round-off
        old = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                a = F.normalize((p - glob[n]).abs(), p=2, dim=0) if adaptive else 1.0
                p.add_(a * g[n] * scale)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(old[n])
        opt.step()
    return federated_state(model)


def test_fedsol_perturbation_matches_the_port_in_float64():
    from fedskew.algorithms.methods.fedsol import fedsol_perturbation

    gen = torch.Generator().manual_seed(4)
    like = {"w": torch.zeros(5, 3), "b": torch.zeros(5)}
    w, wg, g = (rand_state(like, gen) for _ in range(3))
    for adaptive in (True, False):
        ours = fedsol_perturbation({k: v[None] for k, v in w.items()}, {k: v[None] for k, v in g.items()},
                                   {"model." + k: v[None] for k, v in wg.items()}, 0.7, adaptive)
        scale = 0.7 / (torch.sqrt(sum((v ** 2).sum() for v in g.values())) + 1e-12)
        port = {k: (F.normalize((w[k] - wg[k]).abs(), p=2, dim=0) if adaptive else 1.0) * g[k] * scale for k in like}
        assert_close({k: v[0] for k, v in ours.items()}, port, 1e-15)
    zero = fedsol_perturbation({k: v[None] for k, v in w.items()}, {k: v[None] for k, v in g.items()},
                               {"model." + k: v[None] for k, v in w.items()}, 0.7, True)
    assert all(v.abs().max() == 0 for v in zero.values())  # at w = w^g the adaptive step is plain SGD


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("form", ["adaptive", "fixed"])
def test_fedsol_rounds_equal_the_official_client(tmp_path, executor, form):
    rho = 0.5
    exp, init, res, ck = run(tmp_path, executor, ["method=fedsol", f"method.rho={rho}", f"method.form={form}",
                                                 "rounds=2", "method.weighting=uniform"])
    w = dict(init)
    for rnd, h in enumerate(res.history):
        trained = [fedsol_port_train(exp, k, w, rnd, rho, form == "adaptive") for k in h["clients"]]
        w = {n: sum(t[n] for t in trained) / len(trained) for n in w}
    assert_close(ck["global_state"], w, 1e-5)
    if form == "adaptive":  # no round-off direction to scale: the official code's own step, floor or not
        first = res.history[0]["clients"][0]
        assert_close(fedsol_port_train(exp, first, init, 0, rho, True, floor=0.0),
                     fedsol_port_train(exp, first, init, 0, rho, True), 1e-7)


# -- FedRCL (skynbe/FedRCL at 378beb4, utils/loss.py CLLoss as RCLClient._algorithm_rcl calls it) ------------


def rcl_port_rows(pos, neg, temp):
    """MultiLabelCrossEntropyLoss over [pos_p, negatives] / temp per positive p: +inf to -inf, the
    non-finite row losses to 0, the mean over the positives."""
    b, p = pos.shape
    logits = torch.cat([pos.unsqueeze(2), neg.unsqueeze(1).expand(b, p, neg.size(1))], 2) / temp
    logits = logits.masked_fill(torch.isposinf(logits), float("-inf"))
    nll = -F.log_softmax(logits, dim=2)[..., 0]
    return torch.where(torch.isfinite(nll), nll, torch.zeros_like(nll)).mean(1)


def rcl_port_loss(z, y, temp=0.05, topk_pos=1, topk_neg=2, threshold=0.7):
    """The two pairs of the RCL config on one level: 'scl' (supervised, hardest topk_pos positive, self
    included, against the topk_neg hardest negatives) and 'penalty' (unsupervised with
    intra_class_thresholding: self-similarity against the least similar same-class partner, dropped to
    -1 below the threshold); each the batch mean."""
    n = F.normalize(z.flatten(1), p=2, dim=1)
    s = n @ n.t()
    b = s.size(0)
    same = y.unsqueeze(0) == y.unsqueeze(1)
    eye = torch.eye(b, dtype=torch.bool)
    pos = s.masked_fill(~same, float("inf")).topk(topk_pos, dim=1, largest=False).values
    neg = s.masked_fill(same, float("-inf")).topk(min(topk_neg, b), dim=1, largest=True).values
    pos_self = s.masked_fill(~eye, float("inf")).topk(topk_pos, dim=1, largest=False).values
    cand = s.masked_fill(~same | eye, float("inf")).topk(min(topk_pos, b), dim=1, largest=False).values
    cand = torch.where((cand < threshold) | torch.isinf(cand), torch.full_like(cand, -1.0), cand)
    return rcl_port_rows(pos, neg, temp).mean(), rcl_port_rows(pos_self, cand, temp).mean()


@pytest.mark.parametrize("case", range(8))
def test_fedrcl_terms_match_the_port_in_float64(case):
    from fedskew.algorithms.methods.fedrcl import relaxed_contrastive_terms

    gen = torch.Generator().manual_seed(case)
    b, classes = [1, 2, 5, 8, 16, 16, 12, 9][case], [1, 2, 3, 4, 10, 1, 3, 2][case]
    z = torch.randn(b, 6, generator=gen, dtype=torch.float64)
    if case >= 5:  # near-collapsed features: the penalty fires
        z = torch.randn(1, 6, generator=gen, dtype=torch.float64) + 0.05 * z
    z.requires_grad_(True)
    y = torch.randint(classes, (b,), generator=gen)
    scl, pen = relaxed_contrastive_terms(z, y, 0.05, 0.7, 2)
    port_scl, port_pen = rcl_port_loss(z, y)
    ours, port = scl.mean() + pen.mean(), port_scl + port_pen
    assert abs(scl.mean().item() - port_scl.item()) < 1e-13 and abs(pen.mean().item() - port_pen.item()) < 1e-13
    (ga,), (gb,) = torch.autograd.grad(ours, [z]), torch.autograd.grad(port, [z])
    assert (ga - gb).abs().max().item() < 1e-12
    if case >= 5:
        assert pen.mean().item() > 1e-3  # (the penalty is active in the collapsed cases)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_fedrcl_rounds_equal_the_official_client(tmp_path, executor):
    exp, init, res, ck = run(tmp_path, executor, ["method=fedrcl", "rounds=2", "method.weighting=uniform"])

    def loss(model, x, y):
        z, logits = model(x, return_features=True)
        scl, pen = rcl_port_loss(z, y)
        return F.cross_entropy(logits, y) + scl + pen

    w = dict(init)
    for rnd, h in enumerate(res.history):
        trained = [train(exp, k, w, rnd, loss) for k in h["clients"]]
        w = {n: sum(t[n] for t in trained) / len(trained) for n in w}
    assert_close(ck["global_state"], w, 1e-5)
    assert res.history[-1]["train/fedrcl/scl"] > 0


# -- FedLoGe (ZackZikaiXiao/FedLoGe at f4cac52: util/etf_methods.py, fedloge.py, realignment.py) ------------


def loge_port_objective(e, target_norm=0.1):
    """gen_sparse_ETF's loss: (column norms - 0.1)^2 summed, minus the mean arccos of each class's largest
    cosine to another class (clamped to +-0.99999)."""
    k = e.shape[1]
    n = e.norm(dim=0)
    u = e / n
    cos = (u.T @ u).masked_fill(torch.eye(k, dtype=torch.bool), -1.0)
    return ((n - target_norm) ** 2).sum() - torch.acos(cos.max(dim=1).values.clamp(-0.99999, 0.99999)).mean()


def loge_port_sse_c(etf, zero_idx, steps, target_norm=0.1):
    """The flat entries zero_idx of the ETF set to 0, torch.optim.Adam(lr=1e-4) on the loss with the
    gradient multiplied by the non-zero mask; the nn.Linear weight is its transpose."""
    e = etf.detach().clone().reshape(-1)
    e[zero_idx] = 0
    e = e.reshape(etf.shape)
    mask = (e != 0).to(e.dtype)
    e.requires_grad_(True)
    opt = torch.optim.Adam([e], lr=1e-4)
    for _ in range(steps):
        opt.zero_grad()
        loge_port_objective(e, target_norm).backward()
        e.grad.mul_(mask)
        opt.step()
    return e.detach().T


def test_fedloge_sse_c_matches_the_port_in_float64():
    from fedskew.algorithms.methods.fedloge import simplex_etf, sse_c

    gen = torch.Generator().manual_seed(5)
    noise = torch.rand(24, 6, generator=gen, dtype=torch.float64)
    etf = simplex_etf(noise)
    gram = etf.T @ etf
    assert (gram.diagonal() - 1).abs().max() < 1e-12  # unit class vectors, cosines -1 / (C - 1)
    assert (gram.clone().fill_diagonal_(-0.2) + 0.2).abs().max() < 1e-12
    zeros = torch.randperm(24 * 6, generator=gen)[:int(0.6 * 24 * 6)]
    ours, port = sse_c(etf, zeros, 0.1, 400), loge_port_sse_c(etf, zeros, 400)
    assert (ours - port).abs().max().item() < 1e-12
    assert int((ours == 0).sum()) == len(zeros)  # the zeros stay zeros


def test_fedloge_realignment_matches_the_port():
    from fedskew.algorithms.methods.fedloge import global_realignment, local_realignment

    gen = torch.Generator().manual_seed(6)
    aux, loc = torch.randn(5, 7, generator=gen, dtype=torch.float64), torch.randn(5, 7, generator=gen,
                                                                                dtype=torch.float64)
    assert (global_realignment(aux, 1.7) - 1.7 * aux / aux.norm(dim=1, keepdim=True)).abs().max() < 1e-15
    assert (global_realignment(aux, 1.7).norm(dim=1) - 1.7).abs().max() < 1e-12
    assert (local_realignment(aux, loc) - aux * loc.norm(dim=1, keepdim=True)).abs().max() < 1e-15


@pytest.mark.parametrize("executor", EXECUTORS)
def test_fedloge_rounds_equal_the_official_client_and_server(tmp_path, executor):
    from fedskew.models.functional import predict

    exp, init, res, ck = run(tmp_path, executor, ["method=fedloge", "rounds=2", "method.refine_steps=200",
                                                 "method.weighting=uniform"])
    sse = exp.info.fixed_state  # (the run's result holds the scored model: its realigned head in the module)

    def loss(model, x, y):  # update_weights_gaux: three CEs, the heads on detached features
        z = model.backbone(x)
        return (F.cross_entropy(F.linear(z, sse["classifier.weight"], sse["classifier.bias"]), y)
                + F.cross_entropy(model.aux(z.detach()), y)
                + F.cross_entropy(model.local_head(z.detach()), y))

    w, local = dict(init), {}
    for rnd, h in enumerate(res.history):
        trained = []
        for k in h["clients"]:
            start = {**w, **local.get(k, {n: v for n, v in init.items() if n.startswith("local_head.")})}
            t = train(exp, k, start, rnd, loss)
            local[k] = {n: v for n, v in t.items() if n.startswith("local_head.")}
            trained.append(t)
        w = {n: v if n.startswith("local_head.") else sum(t[n] for t in trained) / len(trained) for n, v in w.items()}
    assert_close(ck["global_state"], w, 1e-5)
    for k, heads in local.items():
        assert_close({"local_head." + n[len("loge.local."):]: v for n, v in ck["client_states"][k].items()
                      if n.startswith("loge.local.")}, heads, 1e-5)
    # the global model predicts with the auxiliary head's rows at norm 1.7, its bias kept (globaltest_calibra)
    x, y = exp.fed.data.x_test, exp.fed.data.y_test
    with torch.no_grad():
        load_state(exp.model, w)
        z = exp.model.backbone(x)
        a = exp.model.aux
        port = (z @ (1.7 * a.weight / a.weight.norm(dim=1, keepdim=True)).T + a.bias).argmax(1)
    scored = exp.method.evaluation_state(ck["global_state"], ck["server_state"])
    assert torch.equal(predict(exp.model, scored, x), port)
    assert res.history[-1]["global/test_acc"] == pytest.approx((port == y).float().mean().item())


# -- FedMLB (jinkyu032/FedMLB at d695dbf, local_update_method/FedMLB.py) -------------------------------------


def mlb_port_loss(x, y, local_blocks, global_blocks, temp=1.0):
    """FedMLB.py's loss: CE of the main pathway, plus the mean over branch levels k of the CE of the
    hybrid pathway (local blocks 0..k, then the frozen global blocks) and of KLDivLoss(batchmean)(
    log_softmax(main / T), softmax(hybrid / T)); lambda1 = lambda2 = lambda3 = 1."""
    feats, h = [], x
    for blk in local_blocks:
        h = blk(h)
        feats.append(h)
    z = feats[-1]
    ce_b, kl_b = [], []
    for k in range(len(local_blocks) - 1):
        hk = feats[k]
        for blk in global_blocks[k + 1:]:
            hk = blk(hk)
        ce_b.append(F.cross_entropy(hk, y))
        kl_b.append(torch.nn.KLDivLoss(reduction="batchmean")(F.log_softmax(z / temp, 1), F.softmax(hk / temp, 1)))
    return F.cross_entropy(z, y) + sum(ce_b) / len(ce_b) + sum(kl_b) / len(kl_b)


def mlb_blocks(units, blocks, head):
    """The chain of callables: each block of backbone units, then the classifier."""
    def block(ids):
        def run(h):
            for i in ids:
                h = units[i](h)
            return h
        return run
    return [block(b) for b in blocks] + [head]


def test_fedmlb_blocks_are_the_official_resnet18_levels():
    """models/resnet_FedMLB.py branches after the stem (conv1, bn1, relu) and after layer1..layer4."""
    from fedskew.models.build import build_model
    from fedskew.models.nets import BranchedNet

    net = BranchedNet(build_model(load_config(None, ["model=resnet18"]).model, (3, 32, 32), 10))
    names = [[type(net._units[i]).__name__ for i in b] for b in net.blocks]
    assert names == [["Conv2d", "BatchNorm2d", "ReLU"], ["BasicBlock"] * 2, ["BasicBlock"] * 2, ["BasicBlock"] * 2,
                     ["BasicBlock", "BasicBlock", "AdaptiveAvgPool2d", "Flatten"]]


def test_fedmlb_loss_matches_the_port_in_float64():
    from fedskew.algorithms.methods.fedmlb import multi_level_loss

    gen = torch.Generator().manual_seed(7)
    local = [torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU()), torch.nn.Sequential(
        torch.nn.Linear(5, 4), torch.nn.ReLU()), torch.nn.Linear(4, 3)]
    glob = [torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU()), torch.nn.Sequential(
        torch.nn.Linear(5, 4), torch.nn.ReLU()), torch.nn.Linear(4, 3)]
    for m in (*local, *glob):
        m.double()
    x, y = torch.randn(7, 6, generator=gen, dtype=torch.float64), torch.randint(3, (7,), generator=gen)
    h0 = local[0](x)
    h1 = local[1](h0)
    logits = torch.cat([local[2](h1), glob[2](glob[1](h0)), glob[2](h1)], 1)
    ours, _ = multi_level_loss(logits, y, 3, 1.0, 1.0, 1.0)
    port = mlb_port_loss(x, y, local, glob)
    assert abs(ours.item() - port.item()) < 1e-14
    params = list(local[0].parameters())
    for a, b in zip(torch.autograd.grad(ours, params), torch.autograd.grad(port, params)):
        assert (a - b).abs().max().item() < 1e-14


@pytest.mark.parametrize("executor", EXECUTORS)
def test_fedmlb_rounds_equal_the_official_client(tmp_path, executor):
    import copy

    exp, init, res, ck = run(tmp_path, executor, ["method=fedmlb", "rounds=2", "method.weighting=uniform"])
    net = exp.model
    w = {k: v for k, v in init.items() if not k.startswith("received.")}
    for rnd, h in enumerate(res.history):
        load_state(net, w)
        frozen = copy.deepcopy(net).eval()  # the received model, its blocks frozen
        for p in frozen.parameters():
            p.requires_grad_(False)
        glob = mlb_blocks(frozen._units, frozen.blocks, frozen.classifier)

        def loss(model, x, y, glob=glob):
            return mlb_port_loss(x, y, mlb_blocks(model._units, model.blocks, model.classifier), glob)

        trained = [{k: v for k, v in train(exp, k, {**init, **w}, rnd, loss).items() if not k.startswith("received.")}
                   for k in h["clients"]]
        w = {n: sum(t[n] for t in trained) / len(trained) for n in w}
    assert_close({k: v for k, v in ck["global_state"].items() if not k.startswith("received.")}, w, 1e-5)
    assert res.history[-1]["train/fedmlb/kl"] > 0


# -- APPLE (ljaiverson/pFL-APPLE at 8078196: train_APPLE.py, utils/apple.py) --------------------------------


def apple_port_coef(r, rounds, mu=0.1, frac=0.1):
    """get_reg_coef, exponential scheduler: mu 0.001^(r / L), 0 from L = int(rounds frac) on."""
    last = int(rounds * frac)
    return 0.0 if mu == 0 or r >= last else mu * 0.001 ** (r / last)


def apple_port_client(exp, k, cores, p, p0, rnd, coef, ratio):
    """The client's round: ClientNet's output sum_j p_j layer_j(x) (for affine layers the model with the
    mixed weights), optim.SGD over its own core (lr) and ps (lr_coef = ratio lr), one momentum, fresh each
    round, on CE + coef ||p - p0||^2; the other cores fixed. Returns its trained core and p."""
    from torch.func import functional_call

    batches, _, _ = stage_schedules(exp.executor.settings, exp.method, rnd, k, len(exp.fed.train_idx[k]), exp.cfg.lr)
    own = {n: v.clone().requires_grad_(True) for n, v in cores[k].items()}
    p = p.clone().requires_grad_(True)
    opt = torch.optim.SGD([{"params": list(own.values()), "lr": exp.cfg.lr},
                           {"params": [p], "lr": ratio * exp.cfg.lr}], momentum=exp.cfg.momentum)
    idx = exp.fed.train_idx[k]
    exp.model.train()
    for pos in batches:
        x, y = exp.fed.data.x_train[idx[pos]], exp.fed.data.y_train[idx[pos]]
        theta = {n: sum(p[j] * (own[n] if j == k else cores[j][n]) for j in range(len(cores))) for n in own}
        loss = F.cross_entropy(functional_call(exp.model, theta, (x,)), y) + coef * torch.sum((p - p0) * (p - p0))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: v.detach() for n, v in own.items()}, p.detach()


def test_apple_pull_weight_is_the_official_scheduler():
    from fedskew.algorithms.methods.apple import APPLEOptions, pull_weight

    for r in range(25):
        assert pull_weight(r, 200, APPLEOptions()) == pytest.approx(apple_port_coef(r, 200), rel=1e-15, abs=0)
    assert pull_weight(19, 200, APPLEOptions()) > 0 and pull_weight(20, 200, APPLEOptions()) == 0


@pytest.mark.parametrize("executor", EXECUTORS)
def test_apple_rounds_equal_the_official_client(tmp_path, executor):
    ratio = 0.1
    exp, init, res, ck = run(tmp_path, executor, ["method=apple", "method.cores=independent", "weight_decay=0",
                                                 "method.decay_fraction=1.0", "rounds=3"])
    n = exp.info.class_counts.sum(1).float()
    p0 = n / n.sum()
    names = [k for k in init if k != "apple_p"]
    cores = [{k: init[k] for k in names}] + [{k: v for k, v in exp.info.model_draw(j).items() if k != "apple_p"}
                                              for j in range(1, exp.fed.num_clients)]
    assert (cores[1][names[0]] - cores[0][names[0]]).abs().max() > 1e-3  # independent draws, as the code's
    ps = {}
    for rnd, h in enumerate(res.history):
        coef = apple_port_coef(rnd, 3, frac=1.0)
        out = {k: apple_port_client(exp, k, cores, ps.get(k, p0), p0, rnd, coef, ratio) for k in h["clients"]}
        for k, (core, p) in out.items():
            cores[k], ps[k] = core, p
    for j, core in enumerate(cores):
        assert_close({k: ck["server_state"]["apple.cores." + k][j] for k in names}, core, 1e-5)
    for k, p in ps.items():
        assert_close({"p": ck["client_states"][k]["apple.p"]}, {"p": p}, 1e-5)
        assert (p - p0).abs().max() > 1e-4  # the mixing weights trained


# -- pFedLA (KarhouTam/FL-bench at 06e658b, src/server/pfedla.py; the KarhouTam/pFedLA client) ---------------


def pfedla_port_weights(hn, client_id, num_layers, k=0):
    """HyperNetwork.forward: emb -> three (Linear, ReLU) -> a ReLU(Linear) head per layer; the weights a / sum
    (one-hot where the sum is 0); HeurpFedLA: the top-k raw self-weights' layers one-hot, no gradient."""
    h = hn["emb"][client_id]
    for n in ("l0", "l1", "l2"):
        h = F.relu(h @ hn[n + ".w"].T + hn[n + ".b"])
    a = [F.relu(h @ hn[f"head{layer}.w"].T + hn[f"head{layer}.b"]) for layer in range(num_layers)]
    retained = torch.topk(torch.stack([al[client_id].detach() for al in a]), k).indices.tolist() if k else []
    out = []
    for layer, al in enumerate(a):
        if layer in retained or float(al.detach().sum()) == 0.0:
            al = torch.zeros_like(al).detach()
            al[client_id] = 1.0
        out.append(al / al.sum())
    return out


def pfedla_port_round(hn, models, names, client_id, trained, hn_lr, sign):
    """pFedLAServer.update_hn for one client: the mixture's autograd graph, grad_outputs = theta~ - theta_bar
    (the code's sign) or its negative, a plain SGD step on the client's hypernetwork; theta_i <- theta~."""
    hn = {n: t.detach().clone().requires_grad_(True) for n, t in hn.items()}
    w = pfedla_port_weights(hn, client_id, len(names))
    bar = {n: (torch.stack([m[n] for m in models], -1) * wl).sum(-1) for n, wl in zip(names, w)}
    g = [(trained[n] - bar[n].detach()) * (1 if sign == "flbench" else -1) for n in names]
    grads = torch.autograd.grad([bar[n] for n in names], list(hn.values()), grad_outputs=g, allow_unused=True)
    return {n: (v - hn_lr * d if d is not None else v).detach() for (n, v), d in zip(hn.items(), grads)}


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("sign", ["descent", "flbench"])
def test_pfedla_rounds_equal_the_flbench_server(tmp_path, executor, sign):
    exp, init, res, ck = run(tmp_path, executor, ["method=pfedla", f"method.sign={sign}", "clients_per_round=1",
                                                 "rounds=4"])
    names = list(exp.info.param_names)
    server = exp.method.server_init(init, exp.info)  # (the hypernetworks from the seed, as the run drew them)
    hns = [{k[len("la.hn."):]: v[j] for k, v in server.items() if k.startswith("la.hn.")}
           for j in range(exp.fed.num_clients)]
    models = [dict(init) for _ in range(exp.fed.num_clients)]
    for rnd, h in enumerate(res.history):
        (k,) = h["clients"]
        with torch.no_grad():
            w = pfedla_port_weights(hns[k], k, len(names))
            bar = {n: (torch.stack([m[n] for m in models], -1) * wl).sum(-1) for n, wl in zip(names, w)}
        trained = train(exp, k, bar, rnd, ce)
        hns[k] = pfedla_port_round(hns[k], models, names, k, trained, 0.005, sign)
        models[k] = trained
    for j in range(exp.fed.num_clients):
        assert_close({n: ck["server_state"]["la.models." + n][j] for n in names}, models[j], 1e-5)
        assert_close({n: ck["server_state"]["la.hn." + n][j] for n in hns[j]}, hns[j], 1e-5)
    moved = [k for k in range(exp.fed.num_clients) if (hns[k]["head0.w"] - server["la.hn.head0.w"][k]).abs().max() > 0]
    assert moved  # a hypernetwork stepped


@pytest.mark.parametrize("k", [0, 1])
def test_pfedla_weights_and_mixture_match_the_port_in_float64(k):
    from fedskew.algorithms.methods.pfedla import aggregation_weights, personalised

    gen = torch.Generator().manual_seed(8)
    n, e, hdim, layers = 4, 5, 6, 3
    hn = {"emb": torch.randn(n, e, generator=gen, dtype=torch.float64)}
    for i, fan_in in enumerate((e, hdim, hdim)):
        hn[f"l{i}.w"] = torch.randn(hdim, fan_in, generator=gen, dtype=torch.float64)
        hn[f"l{i}.b"] = torch.randn(hdim, generator=gen, dtype=torch.float64)
    for layer in range(layers):
        hn[f"head{layer}.w"] = torch.rand(n, hdim, generator=gen, dtype=torch.float64)
        hn[f"head{layer}.b"] = torch.zeros(n, dtype=torch.float64)
    hn = {key: v.requires_grad_(True) for key, v in hn.items()}
    ours, port = aggregation_weights(hn, 2, layers, k), pfedla_port_weights(hn, 2, layers, k)
    names = [f"t{layer}" for layer in range(layers)]
    models = {name: torch.randn(n, 3, 2, generator=gen, dtype=torch.float64) for name in names}
    mixed = personalised(models, ours, [[name] for name in names])
    port_mixed = {name: (models[name].permute(1, 2, 0) * w).sum(-1) for name, w in zip(names, port)}
    for layer, name in enumerate(names):
        assert (ours[layer] - port[layer]).abs().max().item() < 1e-15
        assert (mixed[name] - port_mixed[name]).abs().max().item() < 1e-14
    assert sum(float(w.detach().max()) == 1.0 for w in ours) == k  # HeurpFedLA's one-hot layers
    live = [name for name in names if mixed[name].requires_grad]  # (a kept layer has no gradient)
    g = {name: torch.randn(3, 2, generator=gen, dtype=torch.float64) for name in live}
    keys = list(hn)
    a = torch.autograd.grad([mixed[name] for name in live], [hn[x] for x in keys],
                            grad_outputs=[g[name] for name in live], allow_unused=True)
    b = torch.autograd.grad([port_mixed[name] for name in live], [hn[x] for x in keys],
                            grad_outputs=[g[name] for name in live], allow_unused=True)
    for x, y in zip(a, b):
        assert (x is None and y is None) or (x - y).abs().max().item() < 1e-13


# -- PeFLL (jonnyascott/PeFLL at 18659a1, train.py and models.py; FL-bench 06e658b for the resize) -----------


class PeFLLPortEmbed(torch.nn.Module):
    """models.py CNNEmbed (embed_y): the image with the one-hot label as constant channels, a LeNet to R^e
    (resized to 32 x 32 first when smaller, FL-bench's EmbedNetwork, for 8 x 8 digits)."""

    def __init__(self, channels, classes, e):
        super().__init__()
        self.classes = classes
        self.conv1, self.conv2 = torch.nn.Conv2d(channels + classes, 16, 5), torch.nn.Conv2d(16, 32, 5)
        self.fc1, self.fc2, self.fc3 = torch.nn.Linear(800, 120), torch.nn.Linear(120, 84), torch.nn.Linear(84, e)

    def forward(self, x, y):
        x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
        c = torch.zeros(x.shape[0], self.classes, 32, 32, dtype=x.dtype)
        c = c + F.one_hot(y, self.classes).to(x)[..., None, None]
        x = torch.cat((x, c), dim=1)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


class PeFLLPortHyper(torch.nn.Module):
    """models.py CNNHyper: Linear(e, 100), then n_hidden x [ReLU, Linear(100, 100)], a Linear head per tensor."""

    def __init__(self, e, shapes, hidden=100, n_hidden=3):
        super().__init__()
        layers = [torch.nn.Linear(e, hidden)]
        for _ in range(n_hidden):
            layers += [torch.nn.ReLU(), torch.nn.Linear(hidden, hidden)]
        self.mlp, self.shapes = torch.nn.Sequential(*layers), shapes
        self.heads = torch.nn.ModuleDict({n.replace(".", "-"): torch.nn.Linear(hidden, s.numel())
                                          for n, s in shapes.items()})

    def forward(self, v):
        f = self.mlp(v)
        return {n: self.heads[n.replace(".", "-")](f).view(s) for n, s in self.shapes.items()}


def pefll_port_nets(exp, server, dtype):
    """The port's networks holding the run's initial eta_v, eta_h (the method's server_init, from the seed)."""
    shapes = {n: server["pe.shape." + n].tolist() for n in exp.info.param_names}
    shapes = {n: torch.Size(s) for n, s in shapes.items()}
    e = server["pe.v.fc3.weight"].shape[0]
    emb, hyp = PeFLLPortEmbed(1, exp.info.num_classes, e), PeFLLPortHyper(e, shapes)
    ours = {**{"pe.v." + k: k for k in ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight",
                                         "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias")}}
    with torch.no_grad():
        for key, name in ours.items():
            emb.get_parameter(name).copy_(server[key])
        for i, j in enumerate([0, 2, 4, 6]):
            for part in ("weight", "bias"):
                hyp.mlp[j].get_parameter(part).copy_(server[f"pe.h.mlp.{i}.{part}"])
        for n in shapes:
            for part in ("weight", "bias"):
                hyp.heads[n.replace(".", "-")].get_parameter(part).copy_(server[f"pe.h.head.{n}.{part}"])
    return emb.to(dtype), hyp.to(dtype)


def pefll_port_descriptor(emb, x, y, m=None, s=None):
    """train.py: the embeddings summed over the batch, divided by l (+2 per batch: len((x, y))), then (v - m) / s
    with the first descriptor's (m, s), computed without gradient."""
    v = emb(x, y).sum(0) / 2
    if m is None:
        with torch.no_grad():
            m, s = v.mean(), v.std()
    return (v - m) / s, m, s


def pefll_port_round(emb, hyp, opt, clients, clip=50.0):
    """One step of train.py: for each client (descriptor batch, trained model, (m, s)) the joint gradient
    autograd.grad(theta, eta, grad_outputs=theta - theta~), averaged, clip_grad_norm_ 50, Adam."""
    params = list(emb.parameters()) + list(hyp.parameters())
    total = [torch.zeros_like(p) for p in params]
    for (x, y), trained, (m, s) in clients:
        v, _, _ = pefll_port_descriptor(emb, x, y, m, s)
        theta = hyp(v)
        g = torch.autograd.grad(list(theta.values()), params,
                                grad_outputs=[theta[n].detach() - trained[n] for n in theta], allow_unused=True)
        total = [t + (0 if d is None else d) for t, d in zip(total, g)]
    for p, t in zip(params, total):
        p.grad = t / len(clients)
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()


def test_pefll_client_and_server_match_the_port_in_float64(tmp_path):
    """Descriptor, generated model, the clients' gradients and the server's clipped Adam step (several clients,
    the clip active), in float64: fedskew's split (eta_v's gradient on the client, eta_h's on the server from v
    and theta - theta~) against the code's one autograd call over both networks."""
    from fedskew.algorithms.base import ClientData
    from fedskew.algorithms.methods.pefll import descriptor_batch

    exp = Experiment(load_config(None, BASE + ["method=pefll", "method.clip=0.5"]), tmp_path / "x")
    method = exp.method
    server = {k: v.double() if v.is_floating_point() else v for k, v in method.server_init(
        federated_state(exp.model), exp.info).items()}
    emb, hyp = pefll_port_nets(exp, server, torch.float64)
    opt = torch.optim.Adam(list(emb.parameters()) + list(hyp.parameters()), lr=2e-4)
    gen, stat = torch.Generator().manual_seed(4), None
    for rnd in range(3):
        payload = method.broadcast({}, server)
        uploads, port = [], []
        for k in (0, 3, 4):
            idx = exp.fed.train_idx[k]
            x, y = exp.fed.data.x_train[idx].double(), exp.fed.data.y_train[idx]
            state = method.prepare(payload, {}, ClientData(k, rnd, x, y, None))
            pos = descriptor_batch(exp.cfg.seed, rnd, k, len(y), method.batch)
            v, m, s = pefll_port_descriptor(emb, x[pos], y[pos], *(stat or (None, None)))
            theta = hyp(v)
            for n in theta:
                assert (state["pe.w." + n] - theta[n]).abs().max().item() < 1e-12
            trained = {n: t.detach() + 0.05 * torch.randn(t.shape, generator=gen, dtype=torch.float64)
                       for n, t in theta.items()}
            up, kept = method.after_training(trained, payload, state, None)
            assert kept == {}
            uploads.append(up)
            port.append(((x[pos], y[pos]), trained, (m, s)))
        stat = stat or port[0][2]  # the first descriptor's (m, s), frozen
        _, server = method.aggregate(server, {}, uploads, [])
        pefll_port_round(emb, hyp, opt, port, clip=0.5)
        assert_close({k: server["pe.v." + k] for k, _ in emb.named_parameters()}, dict(emb.named_parameters()),
                     1e-12)
        for i, j in enumerate([0, 2, 4, 6]):
            assert (server[f"pe.h.mlp.{i}.weight"] - hyp.mlp[j].weight).abs().max().item() < 1e-12
        for n in exp.info.param_names:
            assert (server[f"pe.h.head.{n}.weight"] - hyp.heads[n.replace(".", "-")].weight).abs().max() < 1e-12
    assert float(server["pe.stat"][1]) > 0  # (m, s) set by the first round and frozen


@pytest.mark.parametrize("executor", EXECUTORS)
def test_pefll_rounds_equal_the_official_loop(tmp_path, executor):
    """Three rounds of two clients: the run's networks against train.py's loop, whose clients train the generated
    model with torch.optim.SGD (the code's 50 steps) and whose server is one autograd call and torch.optim.Adam.
    In the first round each client standardises v by its own (m, s) (the code's later clients use the first's).
    Sequential: equal to the last bit; vectorised: worst 1.7e-6, held to 1e-5 (Adam's first steps are about
    lr sign(g), so round-off in a gradient entry near zero moves its parameter by up to lr)."""
    from fedskew.algorithms.methods.pefll import descriptor_batch

    exp, init, res, ck = run(tmp_path, executor, ["method=pefll"])
    server = exp.method.server_init(init, exp.info)
    emb, hyp = pefll_port_nets(exp, server, torch.float32)
    opt = torch.optim.Adam(list(emb.parameters()) + list(hyp.parameters()), lr=2e-4)
    stat = None
    for rnd, h in enumerate(res.history):
        clients = []
        for k in h["clients"]:
            idx = exp.fed.train_idx[k]
            pos = descriptor_batch(exp.cfg.seed, rnd, k, len(idx), exp.method.batch)
            x, y = exp.fed.data.x_train[idx[pos]], exp.fed.data.y_train[idx[pos]]
            v, m, s = pefll_port_descriptor(emb, x, y, *(stat or (None, None)))
            with torch.no_grad():
                theta = hyp(v)
            clients.append(((x, y), train(exp, k, theta, rnd, ce), (m, s)))
        stat = stat or clients[0][2]
        pefll_port_round(emb, hyp, opt, clients)
    assert_close({k: ck["server_state"]["pe.v." + k] for k, _ in emb.named_parameters()},
                 {k: p.detach() for k, p in emb.named_parameters()}, 1e-5)
    for n in exp.info.param_names:
        assert_close({"w": ck["server_state"][f"pe.h.head.{n}.weight"]},
                     {"w": hyp.heads[n.replace(".", "-")].weight.detach()}, 1e-5)
    moved = (ck["server_state"]["pe.v.fc3.weight"] - server["pe.v.fc3.weight"]).abs().max()
    assert moved > 1e-4  # both networks stepped (Adam: about lr per step)


# -- FedCOG (rui-ye/FedCOG at cf34c0a, fedcog.py and gen_utils/) ------------------------------------------------


def cog_port_plan(counts, size):
    """fedcog.py: deficits max - n_c, the targets floor(size * deficit / sum) per class, syn_lr = N_syn / (N_real +
    N_syn)."""
    c = torch.as_tensor(counts, dtype=torch.float64)
    deficit = c.max() - c
    n_syn, n_real = deficit.sum(), c.sum()
    per_class = [int(size * float(d / n_syn)) for d in deficit]
    return (torch.cat([torch.full((n,), k, dtype=torch.long) for k, n in enumerate(per_class)]),
            float(n_syn / (n_real + n_syn)))


def cog_port_js(s_logits, t_logits, T=1.0):
    """generate_utils.jensen_shanon_div: nn.KLDivLoss(reduction='batchmean') on the clamped log-probabilities."""
    p, q = F.softmax(s_logits / T, dim=1), F.softmax(t_logits / T, dim=1)
    m = 0.5 * (p + q)
    p, q, m = p.clamp(0.01, 0.99), q.clamp(0.01, 0.99), m.clamp(0.01, 0.99)
    kl = torch.nn.KLDivLoss(reduction="batchmean")
    return 1 - (0.5 * kl(p.log(), m) + 0.5 * kl(q.log(), m)).clamp(0.0, 1.0)


def cog_port_synthesise(teacher, student, targets, x0, steps, lr_g=0.01, oh=1.0, adv=0.1):
    """ImageSynthesizer.synthesize: Adam(betas 0.5, 0.9) on the inputs; best_out = the teacher's logits at the
    lowest loss, best_inputs = inputs.data (the live tensor: the last inputs)."""
    x = x0.clone().requires_grad_(True)
    opt = torch.optim.Adam([x], lr_g, betas=(0.5, 0.9))
    best, best_inputs, best_out = 1e6, None, None
    for _ in range(steps):
        opt.zero_grad()
        t, s = teacher(x), student(x)
        loss = oh * F.cross_entropy(t, targets) + adv * cog_port_js(s, t)
        if best > loss.item() or best_inputs is None:
            best, best_inputs, best_out = loss.item(), x.data, t.data
        loss.backward()
        opt.step()
    return best_inputs, best_out


def test_fedcog_plan_and_losses_match_the_port_in_float64():
    from fedskew.algorithms.methods.fedcog import complementary_plan, disagreement

    targets, w_syn = complementary_plan(torch.tensor([50, 10, 0, 40]), 20)
    assert targets.tolist() == [1] * 8 + [2] * 10 + [3] * 2 and w_syn == 0.5  # (by hand)
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        counts = torch.randint(0, 60, (10,), generator=gen)
        ours, port = complementary_plan(counts, 256), cog_port_plan(counts, 256)
        assert ours[0].tolist() == port[0].tolist() and abs(ours[1] - port[1]) < 1e-15
        assert counts.argmax().item() not in ours[0].tolist()
    balanced = complementary_plan(torch.tensor([7, 7, 7]), 256)  # (the code divides 0 by 0)
    assert balanced[0].numel() == 0 and balanced[1] == 0.0
    for scale in (0.1, 1.0, 10.0):
        s, t = (torch.randn(16, 10, generator=gen, dtype=torch.float64) * scale for _ in range(2))
        assert (disagreement(s, t, 2.0) - cog_port_js(s, t, 2.0)).abs().item() < 1e-15
    assert disagreement(s, s, 1.0).item() == 1.0


def test_fedcog_synthesis_matches_the_port_in_float64():
    from fedskew.algorithms.methods.fedcog import FedCOGOptions, synthesise

    gen = torch.Generator().manual_seed(6)
    with torch.random.fork_rng(devices=[]):  # (the layers' initialisation, whatever ran before)
        torch.manual_seed(6)
        teacher, student = torch.nn.Linear(12, 4).double(), torch.nn.Linear(12, 4).double()
    state = {"t": dict(teacher.named_parameters()), "s": dict(student.named_parameters())}

    def call(which, x):  # (z, logits), as FederationInfo.model_call
        w = state[which["id"]]
        return x, F.linear(x.flatten(1), w["weight"].detach(), w["bias"].detach())

    targets = torch.tensor([1, 1, 2, 3, 3, 3])
    x0 = torch.randn(6, 3, 2, 2, generator=gen, dtype=torch.float64)
    opt = FedCOGOptions(g_steps=60)
    x, logits = synthesise(call, {"id": "t"}, {"id": "s"}, targets, x0, opt)
    px, plogits = cog_port_synthesise(lambda v: teacher(v.flatten(1)), lambda v: student(v.flatten(1)), targets, x0, 60)
    assert (x - px).abs().max().item() < 1e-13 and (logits - plogits).abs().max().item() < 1e-13
    with torch.no_grad():  # the global model labels them as planned, more so than where they started
        assert F.cross_entropy(logits, targets) < 0.75 * F.cross_entropy(teacher(x0.flatten(1)), targets)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_fedcog_rounds_equal_the_official_client(tmp_path, executor):
    """A FedAvg round, then two generation rounds (20 Adam steps, 24 inputs): each client's synthesis replayed by the
    port from its student (its last trained model, or the global model it first received) and the run's draw of
    the inputs, then its training replayed as fedcog.py's loop: torch.optim.SGD on the nn.Module, the real batch's
    weighted CE and the synthetic batch's weighted KD as two backward passes, one step."""
    from fedskew.algorithms.methods.fedcog import complementary_plan
    from fedskew.streams import torch_seed

    exp, init, res, ck = run(tmp_path, executor, ["method=fedcog", "method.start_round=1", "method.g_steps=20",
                                                 "method.synthesis_size=24", "method.weighting=uniform"])
    model, glob, kept, made = exp.model, dict(init), {}, 0

    def net(state):  # the module in eval mode with a state (FederationInfo.model_call's form)
        model.eval()
        return lambda x: torch.func.functional_call(model, state, (x,))

    for rnd, h in enumerate(res.history):
        trained = []
        for k in h["clients"]:
            idx = exp.fed.train_idx[k]
            student = kept.get(k, glob)
            targets, w = complementary_plan(exp.info.class_counts[k], 24)
            if rnd < 1 or not len(targets):  # FedAvg's round; a client with balanced classes has nothing to make
                trained.append(train(exp, k, glob, rnd, ce))
                kept[k] = trained[-1]
                continue
            gen = torch.Generator().manual_seed(torch_seed(exp.cfg.seed, "fedcog_inputs", rnd, k))
            x0 = torch.randn((len(targets), *exp.fed.data.x_train.shape[1:]), generator=gen)
            sx, st = cog_port_synthesise(net(glob), net({n: v.clone() for n, v in student.items()}), targets, x0, 20)
            made += 1
            pair = torch.randperm(len(targets), generator=gen)[torch.arange(len(idx)) % len(targets)]
            batches, _, _ = stage_schedules(exp.executor.settings, exp.method, rnd, k, len(idx), exp.cfg.lr)
            load_state(model, glob)
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=exp.cfg.lr, momentum=exp.cfg.momentum,
                                  weight_decay=exp.cfg.weight_decay)
            for pos in batches:
                model.zero_grad()
                ((1 - w) * F.cross_entropy(model(exp.fed.data.x_train[idx[pos]]), exp.fed.data.y_train[idx[pos]])
                 ).backward()
                s_logits, t_logits = model(sx[pair[pos]]), st[pair[pos]]
                (w * F.kl_div(F.log_softmax(s_logits, 1), F.softmax(t_logits, 1), reduction="batchmean")).backward()
                opt.step()
            trained.append(federated_state(model))
            kept[k] = trained[-1]
        glob = {n: sum(t[n] for t in trained) / len(trained) for n in glob}
    assert made >= 3  # clients that generated and distilled
    assert_close(ck["global_state"], glob, 1e-6)


def test_a_model_the_method_cannot_build_on_is_one_sentence(tmp_path):
    """FedLoGe's ETF classifier needs d >= C; a real process, its exit status and its one sentence."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "fedskew.cli", "run", "method=fedloge", "model.hidden=[8,4]",
                           "rounds=1", "--out", str(tmp_path / "r")], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "fedskew: error: method fedloge needs a feature dimension of at least the 10 classes for its ETF classifier, "
        "but the model gives 4; widen the model's last hidden layer.")
    assert not (tmp_path / "r").exists()  # nothing written
