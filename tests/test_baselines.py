"""Generic-FL baselines against their papers' update rules, worked out independently in numpy.

The problem: multinomial logistic regression (a linear model W [C, d], b [C]; model `mlp` with no
hidden layer) on 3 clients of unequal sizes (Dirichlet), 2 clients per round, 2 rounds, 2 local
epochs of plain SGD (batch 4, so clients take different numbers of steps tau_k), lr 0.1. The
reference below recomputes every round in float64 from the papers' rules:

    gradient of mean CE:  G = (softmax(X W^T + b) - onehot(y)) / n;  dW = G^T X,  db = sum G
    FedAvg:   x <- sum_k p_k y_k,  p_k = n_k / sum n
    FedProx:  local gradient + mu (w - x)
    SCAFFOLD: local y <- y - eta (g + c - c_k);  c_k+ = c_k - c + (x - y) / (tau_k eta);
              x <- x + eta_g sum p_k (y_k - x);  c <- c + (1/N) sum_{k in S} (c_k+ - c_k),  N = 3
    FedDyn:   local gradient - g_k + alpha (w - x);  g_k <- g_k - alpha (y_k - x);
              h <- h - alpha (1/N) sum_S (y_k - x);  x <- mean_S y_k - h / alpha
    FedDC:    w_k = n_k / mean n (official code; 1 with by_data_size=false);
              local gradient + (alpha / w_k) (w + h_k - x) + c / w_k - c_k;  h_k <- h_k + (y_k - x);
              c_k+ = c_k - c / w_k + (x - y_k) / (S eta), S = E ceil(mean n / B) (official code's
              fixed count) or tau_k;  c <- c + (1/N) sum_S w_k (c_k+ - c_k);
              code: x <- mean_S y_k + (1/N) sum_all h_k;  paper: x <- mean_S (y_k + h_k)
    FedNova:  a_k = tau_k (no momentum);  x <- x - (sum p_k a_k) sum p_k (x - y_k) / a_k
    FedAvgM:  m <- beta m + Delta;  x <- x + eta_g m,  Delta = sum p_k y_k - x
    FedAdam:  m <- b1 m + (1-b1) Delta;  v <- b2 v + (1-b2) Delta^2 (v0 = tau^2);
              x <- x + eta_g m / (sqrt v + tau)
    FedYogi:  v <- v - (1-b2) Delta^2 sign(v - Delta^2)
    GHBM:     local gradient g + beta m / (eta tau_k), m = (x_{t+1-tau} - x_{t+1}) / tau once tau rounds ran
    LocalGHBM: local gradient g + beta C (a_k - x) / (eta tau_k), C = 2/3, a_k the model client k received
              when it last took part (no term at its first round); then a_k <- x
    FedHBM:   local gradient g + beta C (a_k - w) / (eta tau_k), a_k the model client k trained when it last
              took part; then a_k <- y_k
    FedCM:    local gradient alpha g + (1 - alpha) Delta / (eta tau_k);  x <- sum p_k y_k;  Delta <- x_old - x
    FedExP:   eta_g = max(1, sum p_k ||y_k - x||^2 / (2 (||Delta||^2 + |S| eps)));  x <- x + eta_g Delta;
              scored: the mean of the last two x (from the second round on)

The batches are the engine's (``batch_schedule``): the order is an input here, the arithmetic is not.
"""

import numpy as np
import pytest
import torch

from fedskew.algorithms.methods.fednova import FedNova
from fedskew.config import load_config
from fedskew.engine.protocol import batch_schedule
from fedskew.engine.rundir import read_checkpoint
from fedskew.engine.runner import Experiment, run

SETUP = ["dataset=synthetic", "dataset.num_classes=3", "dataset.dim=4", "dataset.train_per_class=10",
         "dataset.test_per_class=5", "partition=dirichlet", "partition.alpha=1.0", "partition.min_size=4",
         "partition.num_clients=3", "partition.local_test_fraction=0", "clients_per_round=2", "rounds=2",
         "local_epochs=2", "batch_size=4", "lr=0.1", "momentum=0", "weight_decay=0", "model.hidden=[]",
         "final_personalization=false", "seed=4"]


def softmax(z):
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def grad(w, b, x, y, c):
    g = (softmax(x @ w.T + b) - np.eye(c)[y]) / len(y)
    return g.T @ x, g.sum(0)


def reference(method: str, opts: dict, exp: Experiment, schedule: list[list[int]]):
    fed, s = exp.fed, exp.executor.settings
    c = fed.num_classes
    xs = [fed.data.x_train[i].double().numpy().reshape(len(i), -1) for i in fed.train_idx]
    ys = [fed.data.y_train[i].numpy() for i in fed.train_idx]
    n = np.array([len(y) for y in ys], dtype=float)
    init = {k: v.double().numpy() for k, v in exp.model.state_dict().items()}
    x = [init["classifier.weight"], init["classifier.bias"]]
    def zeros():
        return [np.zeros_like(x[0]), np.zeros_like(x[1])]
    cs, ck = zeros(), {k: zeros() for k in range(3)}  # SCAFFOLD/FedDC c, c_k; FedDyn h, g_k
    hk = {k: zeros() for k in range(3)}  # FedDC drifts
    m, v = zeros(), [np.full_like(x[0], opts.get("tau", 1e-3) ** 2), np.full_like(x[1], opts.get("tau", 1e-3) ** 2)]
    eta = 0.1
    past, ghbm_m = [], zeros()  # GHBM's queue of models and its momentum
    anchors = {}  # LocalGHBM's and FedHBM's per-client anchors
    wk = n / n.mean() if opts.get("by_data_size", True) else np.ones_like(n)  # FedDC client weights
    fixed_steps = s.epochs * int(np.ceil(n.mean() / s.batch_size))
    for t, selected in enumerate(schedule):
        ys_out, taus = {}, {}
        official = method == "fedexp" and opts.get("schedule", "official") == "official"
        eta = 0.1 * (0.998 ** (t + 1) if official else 1.0)  # FedExP's official decay of the local lr
        for k in selected:
            w = [x[0].copy(), x[1].copy()]
            batches = batch_schedule(s, t, k, len(ys[k]))
            if opts.get("local_steps"):  # FedExP's fixed steps: the batch stream cut after them
                per_epoch = int(np.ceil(len(ys[k]) / s.batch_size))
                batches = batch_schedule(s, t, k, len(ys[k]), -(-opts["local_steps"] // per_epoch))
                batches = batches[:opts["local_steps"]]
            for pos in batches:
                gw, gb = grad(w[0], w[1], xs[k][pos], ys[k][pos], c)
                g = [gw, gb]
                for j in range(2):
                    if method == "fedprox":
                        g[j] = g[j] + opts["mu"] * (w[j] - x[j])
                    if method == "scaffold":
                        g[j] = g[j] + cs[j] - ck[k][j]
                    if method == "feddyn":
                        g[j] = g[j] - ck[k][j] + opts["alpha"] * (w[j] - x[j])
                    if method == "fedcm":  # alpha g + (1 - alpha) Delta / (lr K_k), K_k the client's steps
                        a = opts.get("alpha", 0.1)
                        g[j] = a * g[j] + (1 - a) * m[j] / (eta * len(batches))
                    if method == "ghbm":  # g + beta m / (lr K_k)
                        g[j] = g[j] + opts.get("beta", 0.9) * ghbm_m[j] / (eta * len(batches))
                    if method in ("localghbm", "fedhbm") and k in anchors:  # g + beta C (a_k - x or w) / (lr K_k)
                        beta = opts.get("beta", 0.9 if method == "localghbm" else 1.0)
                        end = x[j] if method == "localghbm" else w[j]
                        g[j] = g[j] + beta * (2 / 3) * (anchors[k][j] - end) / (eta * len(batches))
                    if method == "feddc":
                        g[j] = g[j] + opts["alpha"] / wk[k] * (w[j] + hk[k][j] - x[j]) + cs[j] / wk[k] - ck[k][j]
                    w[j] = w[j] - eta * g[j]
            ys_out[k], taus[k] = w, len(batches)
            anchors[k] = x if method == "localghbm" else w
        p = n[selected] / n[selected].sum()
        avg = [sum(pk * ys_out[k][j] for pk, k in zip(p, selected)) for j in range(2)]
        if method in ("fedavg", "fedprox", "localghbm", "fedhbm"):
            x = avg
        elif method == "ghbm":  # the last tau pre-aggregation models; m = (oldest - new) / tau once tau are held
            past = (past + [x])[-opts["tau"]:]
            x = avg
            ghbm_m = [(past[0][j] - x[j]) / opts["tau"] for j in range(2)] if len(past) >= opts["tau"] else zeros()
        elif method == "fedcm":  # FedAvg's mean; Delta = x - mean for the next round
            m = [x[j] - avg[j] for j in range(2)]
            x = avg
        elif method == "scaffold":
            dc = {}
            for k in selected:
                new = [ck[k][j] - cs[j] + (x[j] - ys_out[k][j]) / (taus[k] * eta) for j in range(2)]
                dc[k] = [new[j] - ck[k][j] for j in range(2)]
                ck[k] = new
            x = [x[j] + opts.get("server_lr", 1.0) * (avg[j] - x[j]) for j in range(2)]
            cs = [cs[j] + sum(dc[k][j] for k in selected) / 3 for j in range(2)]
        elif method == "feddyn":
            a = opts["alpha"]
            for k in selected:
                ck[k] = [ck[k][j] - a * (ys_out[k][j] - x[j]) for j in range(2)]
            mean = [sum(ys_out[k][j] for k in selected) / len(selected) for j in range(2)]
            cs = [cs[j] - a * sum(ys_out[k][j] - x[j] for k in selected) / 3 for j in range(2)]
            x = [mean[j] - cs[j] / a for j in range(2)]
        elif method == "feddc":
            dc = {}
            for k in selected:
                hk[k] = [hk[k][j] + ys_out[k][j] - x[j] for j in range(2)]
                steps = fixed_steps if opts.get("control_steps", "fixed") == "fixed" else taus[k]
                new = [ck[k][j] - cs[j] / wk[k] + (x[j] - ys_out[k][j]) / (steps * eta) for j in range(2)]
                dc[k] = [(new[j] - ck[k][j]) * wk[k] for j in range(2)]
                ck[k] = new
            cs = [cs[j] + sum(dc[k][j] for k in selected) / 3 for j in range(2)]
            if opts.get("aggregation", "code") == "paper":
                x = [sum(ys_out[k][j] + hk[k][j] for k in selected) / len(selected) for j in range(2)]
            else:
                x = [sum(ys_out[k][j] for k in selected) / len(selected) + sum(hk[k][j] for k in range(3)) / 3
                     for j in range(2)]
        elif method == "fedexp":  # Algorithm 1 with the official code's |S| eps, scored on the last-two mean
            spread = sum(pk * sum(((ys_out[k][j] - x[j]) ** 2).sum() for j in range(2)) for pk, k in zip(p, selected))
            delta = [avg[j] - x[j] for j in range(2)]
            eps = opts.get("epsilon", 1e-3) * (
                len(selected) if opts.get("epsilon_scale", "clients") == "clients" else 1
            )
            eps *= 0.998 ** (2 * (t + 1)) if official else 1.0
            eta_g = max(1.0, 0.5 * spread / (sum((d ** 2).sum() for d in delta) + eps))
            opts.setdefault("_etas", []).append(eta_g)
            prev, x = x, [x[j] + eta_g * delta[j] for j in range(2)]
            if t == len(schedule) - 1 and t > 0 and opts.get("eval_average", True):
                return [(x[j] + prev[j]) / 2 for j in range(2)]
        elif method == "fednova":
            a_k = np.array([taus[k] for k in selected], dtype=float)
            tau_eff = (p * a_k).sum()
            x = [x[j] - tau_eff * sum(pk / ak * (x[j] - ys_out[k][j]) for pk, ak, k in zip(p, a_k, selected))
                 for j in range(2)]
        else:
            delta = [avg[j] - x[j] for j in range(2)]
            b1 = opts.get("beta1", 0.0 if method == "fedadagrad" else 0.9)
            b2, tau, lr_g = opts.get("beta2", 0.99), opts.get("tau", 1e-3), opts["server_lr"]
            for j in range(2):
                if method == "fedavgm":
                    m[j] = b1 * m[j] + delta[j]
                    x[j] = x[j] + lr_g * m[j]
                    continue
                m[j] = b1 * m[j] + (1 - b1) * delta[j]
                d2 = delta[j] ** 2
                if method == "fedadagrad":  # Reddi et al. Algorithm 2: v accumulates
                    v[j] = v[j] + d2
                else:
                    v[j] = (
                        b2 * v[j] + (1 - b2) * d2 if method == "fedadam" else v[j] - (1 - b2) * d2 * np.sign(v[j] - d2)
                    )
                x[j] = x[j] + lr_g * m[j] / (np.sqrt(v[j]) + tau)
    return x


CASES = [
    ("fedavg", {}),
    ("fedprox", {"mu": 0.5}),
    ("scaffold", {"server_lr": 0.7}),
    ("feddyn", {"alpha": 0.1}),
    ("feddc", {"alpha": 0.1}),  # the official code's rules (the defaults)
    ("feddc", {"alpha": 0.1, "aggregation": "paper", "by_data_size": False, "control_steps": "steps"}),
    ("fednova", {}),
    ("fedavgm", {"server_lr": 1.0, "beta1": 0.8}),
    ("fedadam", {"server_lr": 0.05}),
    ("fedyogi", {"server_lr": 0.05}),
    ("fedadagrad", {"server_lr": 0.05}),                 # its default: no server momentum
    ("fedadagrad", {"server_lr": 0.05, "beta1": 0.5}),   # Algorithm 2's momentum
    ("ghbm", {"tau": 1}),  # classical heavy-ball momentum on the server's displacement
    ("ghbm", {"tau": 2, "beta": 0.5}),
    ("localghbm", {}),
    ("fedhbm", {}),
    ("fedhbm", {"beta": 0.5}),
    ("fedcm", {}),
    ("fedcm", {"alpha": 0.4}),
    ("fedexp", {"epsilon": 1e-3}),  # the official code's step size, scored on the mean of the last two
    ("fedexp", {"epsilon": 0.1, "epsilon_scale": "paper", "eval_average": False, "schedule": "constant"}),
    ("fedexp", {"epsilon": 0.01, "local_steps": 7}),  # the official code's fixed steps (its cp)
]


@pytest.mark.parametrize("method,opts", CASES)
@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_two_rounds_match_the_papers_rules(tmp_path, method, opts, executor):
    setup = SETUP
    if method == "fedexp":  # it extrapolates where the clients' updates disagree: three clients of one class each
        setup = [a for a in SETUP if not a.startswith(("partition", "rounds", "local_epochs", "clients_per_round"))] + [
            "partition=pcdd", "partition.classes_per_client=1", "partition.num_clients=3",
            "partition.local_test_fraction=0", "clients_per_round=3", "rounds=4", "local_epochs=5"]
    if method in ("ghbm", "localghbm", "fedhbm"):  # (tau = 2 rounds of models before the momentum exists,
        # then a round that uses it; a client that returns in round 2 or 3 has an anchor)
        setup = [a for a in SETUP if not a.startswith("rounds")] + ["rounds=3"]
    cfg = load_config(None, setup + [f"method={method}", f"executor={executor}"]
                      + [f"method.{k}={v}" for k, v in opts.items()])
    exp = Experiment(cfg, tmp_path / "probe")
    sizes = sorted(len(i) for i in exp.fed.train_idx)
    assert len(set(sizes)) > 1 or method == "fedexp"  # unequal clients, so FedNova's tau_k differ
    res = run(cfg, tmp_path / "run")
    opts = dict(opts)
    w_ref, b_ref = reference(method, opts, exp, [h["clients"] for h in res.history])
    if method == "fedexp":  # it extrapolated (eta_g > 1) in this problem, as the server state says
        assert max(opts["_etas"]) > 1.1, opts["_etas"]
        assert float(read_checkpoint(res.run_dir / "checkpoint.pt")["server_state"]["eta_g"]) == \
            pytest.approx(opts["_etas"][-1], rel=1e-5)
    assert all(len(h["clients"]) == 2 + (method == "fedexp") for h in res.history)  # N = 3 differs from |S| = 2
    np.testing.assert_allclose(res.global_state["classifier.weight"].double().numpy(), w_ref, atol=2e-6)
    np.testing.assert_allclose(res.global_state["classifier.bias"].double().numpy(), b_ref, atol=2e-6)


def test_methods_differ_from_fedavg_on_this_problem(tmp_path):
    """Guard against a reference that degenerates to FedAvg: every method moves the result."""
    base = run(load_config(None, SETUP), tmp_path / "avg").global_state["classifier.weight"]
    base3 = run(load_config(None, SETUP + ["rounds=3"]), tmp_path / "avg3").global_state["classifier.weight"]
    for i, (method, opts) in enumerate(CASES[1:]):
        if method == "fedexp":  # (FedAvg wherever eta_g = 1, as here: its own setting checks eta_g > 1)
            continue
        rounds = ["rounds=3"] if method in ("ghbm", "localghbm", "fedhbm") else []
        cfg = load_config(None, SETUP + rounds + [f"method={method}"] + [f"method.{k}={v}" for k, v in opts.items()])
        other = run(cfg, tmp_path / f"{method}{i}").global_state["classifier.weight"]
        assert (other - (base3 if rounds else base)).abs().max() > 1e-4, method


def test_fednova_a_i_with_momentum_by_hand():
    # a = [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho): tau=3, rho=0.5 -> (3 - 0.875) / 0.5
    assert FedNova.a_i(3, 0.5) == pytest.approx(4.25)
    assert FedNova.a_i(7, 0.0) == 7.0
    # rho -> 0 limit and growth towards tau / (1 - rho) for long runs
    assert FedNova.a_i(3, 1e-9) == pytest.approx(3.0, rel=1e-6)
    assert FedNova.a_i(1000, 0.9) == pytest.approx((1000 - 9) / 0.1, rel=1e-6)


def test_scaffold_and_feddyn_communication_and_state(tmp_path):
    res = run(load_config(None, SETUP + ["method=scaffold"]), tmp_path / "s")
    theta = 3 * 4 + 3
    assert res.history[0]["comm/down_floats"] == 2 * 2 * theta  # model + c, 2 clients
    assert res.history[0]["comm/up_floats"] == 2 * 2 * theta    # model + delta c_i
    res = run(load_config(None, SETUP + ["method=feddyn"]), tmp_path / "d")
    assert res.history[0]["comm/up_floats"] == 2 * theta


def test_moon_contrastive_on_hand_vectors():
    from fedskew.algorithms.methods.moon import moon_contrastive

    z = torch.tensor([[1.0, 0.0]])
    z_glob = torch.tensor([[1.0, 1.0]])   # cos = 1/sqrt(2)
    z_prev = torch.tensor([[0.0, -2.0]])  # cos = 0
    tau = 0.5
    sg, sp = (1 / np.sqrt(2)) / tau, 0.0
    expected = -np.log(np.exp(sg) / (np.exp(sg) + np.exp(sp)))
    assert moon_contrastive(z, z_glob, z_prev, tau).item() == pytest.approx(expected, rel=1e-6)
    # direction: moving z towards the global representation lowers the loss
    closer = moon_contrastive(torch.tensor([[1.0, 0.5]]), z_glob, z_prev, tau)
    assert closer.item() < expected


def test_moon_first_round_has_no_contrastive_term(tmp_path):
    cfg = load_config(None, SETUP + ["method=moon", "method.mu=5"])
    moon = run(cfg, tmp_path / "moon").history
    avg = run(load_config(None, SETUP), tmp_path / "avg").history
    # round 0: every client is new, so MOON's loss is FedAvg's
    assert moon[0]["train/loss"] == pytest.approx(avg[0]["train/loss"], rel=1e-6)
    assert moon[0]["train/moon/contrastive"] > 0  # computed (and logged) but weighted by zero


def test_mmd_on_two_tiny_samples_by_hand():
    from fedskew.algorithms.tensors import mmd2

    x, y = torch.tensor([[0.0], [1.0]]), torch.tensor([[3.0]])
    # pooled points 0, 1, 3: squared distances 1, 9, 4 -> b0 = 2 * (1 + 9 + 4) / 6 = 14 / 3
    b0 = 14 / 3
    def k(d2):
        return sum(np.exp(-d2 / (s * b0)) for s in (0.25, 0.5, 1.0, 2.0, 4.0))
    kxx = (2 * k(0) + 2 * k(1)) / 4
    kyy = k(0)
    kxy = (k(9) + k(4)) / 2
    assert mmd2(x, y).item() == pytest.approx(kxx + kyy - 2 * kxy, rel=1e-6)
    assert mmd2(x, x).item() == pytest.approx(0.0, abs=1e-6)


def test_fedaws_spreadout_value_and_direction():
    from fedskew.algorithms.methods.fedaws import spreadout

    w = torch.tensor([[1.0, 0.0], [1.0, 1.0], [-1.0, 0.0]])
    # cosine distances: d01 = (1 - 1/sqrt2)/2 = 0.1464, d02 = 1, d12 = (1 + 1/sqrt2)/2 = 0.8536
    d01 = (1 - 1 / np.sqrt(2)) / 2
    expected = 2 * (0.5 - d01) ** 2 / 6  # only the pair (0, 1) is inside the margin; 6 ordered pairs
    assert spreadout(w, 0.5).item() == pytest.approx(expected, rel=1e-6)
    w.requires_grad_(True)
    (g,) = torch.autograd.grad(spreadout(w, 0.5), w)
    moved = (w - 0.5 * g).detach()
    cos = torch.nn.functional.cosine_similarity(moved[0], moved[1], dim=0)
    assert cos < 1 / np.sqrt(2)  # one step pushes rows 0 and 1 apart
    assert torch.equal(g[2], torch.zeros(2))  # row 2 is outside every margin


def test_projection_head_model():
    from fedskew.config import ModelConfig
    from fedskew.models import build_model

    model = build_model(ModelConfig(name="mlp", hidden=[32], projection_dim=16), (1, 8, 8), 10)
    z, logits = model(torch.randn(3, 1, 8, 8), return_features=True)
    assert z.shape == (3, 16) and logits.shape == (3, 10) and model.classifier.in_features == 16


def test_fedproc_contrastive_by_hand_and_schedule(tmp_path):
    from fedskew.algorithms.methods.fedproc import proto_contrastive

    protos = torch.tensor([[1.0, 0.0], [0.0, 1.0], [float("nan"), float("nan")]])
    z = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    y = torch.tensor([0, 2])  # the second sample's class has no prototype
    loss, usable = proto_contrastive(z, y, protos, 0.5)
    # sample 0: cosines (1, 0) / 0.5 -> -log(e^2 / (e^2 + e^0))
    assert loss[0].item() == pytest.approx(-np.log(np.exp(2) / (np.exp(2) + 1)), rel=1e-6)
    assert usable.tolist() == [True, False] and loss[1].item() == 0.0

    res = run(load_config(None, SETUP + ["method=fedproc", "rounds=3"]), tmp_path / "p")
    avg = run(load_config(None, SETUP + ["rounds=1"]), tmp_path / "a")
    # round 0: no prototypes, so the loss is plain CE, exactly as FedAvg's round 0
    assert res.history[0]["train/loss"] == pytest.approx(avg.history[0]["train/loss"], rel=1e-6)
    c, d = 3, 4
    theta = c * d + c
    assert res.history[0]["comm/down_floats"] == 2 * (theta + c * d + 1)  # model, prototypes, a_t
    assert res.history[0]["comm/up_floats"] == 2 * (theta + c * d + c)


def test_momentum_aware_control_update_by_hand():
    """control_steps=momentum divides option II's update by FedNova's a_i instead of tau: with
    tau = 3, rho = 0.5: a = [3 - 0.5 (1 - 0.125) / 0.5] / 0.5 = 4.25; with rho = 0 both are tau."""
    from fedskew.algorithms.base import ClientReport
    from fedskew.algorithms.drift import control_scale, effective_steps

    assert effective_steps(3, 0.5) == pytest.approx(4.25)
    assert effective_steps(3, 0.0) == 3.0
    r = ClientReport(0, 10, 3, lr=0.1, momentum=0.5)
    assert control_scale(r, "steps") == pytest.approx(1 / 0.3)
    assert control_scale(r, "momentum") == pytest.approx(1 / 0.425)
    plain = ClientReport(0, 10, 3, lr=0.1, momentum=0.0)
    assert control_scale(plain, "momentum") == control_scale(plain, "steps")


def test_localghbm_is_ghbm_under_full_participation(tmp_path):
    """With every client in every round, C = 1 and GHBM's tau = 1: the model a client received last
    round is x_{t-1}, so LocalGHBM's momentum x_{t-1} - x_t is GHBM's, step for step."""
    setup = [a for a in SETUP if not a.startswith(("clients_per_round", "rounds"))] + [
        "clients_per_round=3",
        "rounds=4",
    ]
    ghbm = run(load_config(None, setup + ["method=ghbm"]), tmp_path / "ghbm").global_state
    local = run(load_config(None, setup + ["method=localghbm"]), tmp_path / "local").global_state
    avg = run(load_config(None, setup), tmp_path / "avg").global_state
    for k, v in ghbm.items():
        torch.testing.assert_close(local[k], v, rtol=0, atol=1e-6)
    assert (avg["classifier.weight"] - ghbm["classifier.weight"]).abs().max() > 1e-3  # the momentum acted


def fedcross_reference(exp: Experiment, schedule: list[list[int]], alpha: float, strategy: str):
    """FedCross (PFLlib's servercross, re-derived): K = 3 middleware models; the round's i-th client
    trains model slot_i (the run's seeded assignment: an input here); the global model is the
    n_k-weighted mean of the trained models; model j <- alpha w_j + (1 - alpha) w_c, c the least
    (most) similar other model by the cosine of [W, b] (PFLlib counts the one weight/bias pair
    twice: the same order), or j + (t mod 2) + 1 in order."""
    from fedskew.streams import numpy_rng

    fed, s = exp.fed, exp.executor.settings
    xs = [fed.data.x_train[i].double().numpy().reshape(len(i), -1) for i in fed.train_idx]
    ys = [fed.data.y_train[i].numpy() for i in fed.train_idx]
    n = np.array([len(y) for y in ys], dtype=float)
    init = {k: v.double().numpy() for k, v in exp.model.state_dict().items()}
    models = [[init["classifier.weight"].copy(), init["classifier.bias"].copy()] for _ in range(3)]
    for t, selected in enumerate(schedule):
        slots = numpy_rng(exp.cfg.seed, "fedcross", t).permutation(3)[:len(selected)]
        trained = {}
        for k, j in zip(selected, slots):
            w = [models[j][0].copy(), models[j][1].copy()]
            for pos in batch_schedule(s, t, k, len(ys[k])):
                gw, gb = grad(w[0], w[1], xs[k][pos], ys[k][pos], 3)
                w = [w[0] - 0.1 * gw, w[1] - 0.1 * gb]
            trained[k] = models[j] = w
        p = n[selected] / n[selected].sum()
        glob = [sum(pk * trained[k][i] for pk, k in zip(p, selected)) for i in range(2)]
        flat = [np.concatenate([m[0].ravel(), m[1]]) for m in models]
        sim = np.array([[flat[a] @ flat[b] / np.linalg.norm(flat[a]) / np.linalg.norm(flat[b]) for b in range(3)]
                        for a in range(3)])
        partner = []
        for j in range(3):
            others = [c for c in range(3) if c != j]
            if strategy == "in_order":
                partner.append((j + t % 2 + 1) % 3)
            else:
                pick = min if strategy == "lowest" else max
                partner.append(pick(others, key=lambda c: sim[j, c]))
        models = [[alpha * models[j][i] + (1 - alpha) * models[partner[j]][i] for i in range(2)] for j in range(3)]
    return glob, models


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
@pytest.mark.parametrize("opts", [{}, {"alpha": 0.6}, {"alpha": 0.6, "strategy": "highest"},
                                  {"alpha": 0.6, "strategy": "in_order"}])
def test_fedcross_matches_a_replay_of_its_cross_aggregation(tmp_path, opts, executor):
    setup = [a for a in SETUP if not a.startswith(("partition.num_clients", "clients_per_round", "rounds"))]
    cfg = load_config(None, setup + ["partition.num_clients=4", "clients_per_round=3", "rounds=3", "method=fedcross",
                                     f"executor={executor}"] + [f"method.{k}={v}" for k, v in opts.items()])
    exp = Experiment(cfg, tmp_path / "probe")
    res = run(cfg, tmp_path / "run")
    glob, models = fedcross_reference(exp, [h["clients"] for h in res.history], opts.get("alpha", 0.99),
                                      opts.get("strategy", "lowest"))
    np.testing.assert_allclose(res.global_state["classifier.weight"].double().numpy(), glob[0], atol=2e-6)
    np.testing.assert_allclose(res.global_state["classifier.bias"].double().numpy(), glob[1], atol=2e-6)
    kept = read_checkpoint(res.run_dir / "checkpoint.pt")["server_state"]
    for j in range(3):
        np.testing.assert_allclose(kept["cross.models.classifier.weight"][j].double().numpy(), models[j][0], atol=2e-6)
    # the global model is not what the next round trains from: the middleware models differ from it
    assert np.abs(models[0][0] - glob[0]).max() > 1e-3


@pytest.mark.parametrize("buffers", ["pflib", "own"])
def test_fedcross_buffers_follow_pflibs_cross_aggregation(buffers):
    """PFLlib's ``aggregate_parameters_cross`` deep-copies the first (lower-indexed) model of each
    pair and averages its parameters only: middleware model j carries the buffers of model
    min(j, partner_j) (``buffers=own``: its own); the parameters are alpha w_j + (1 - alpha) w_c."""
    from fedskew.algorithms.base import ClientReport, FederationInfo
    from fedskew.algorithms.methods.fedcross import FedCross, FedCrossOptions, collaborator, layer_pair_similarity

    info = FederationInfo(num_clients=3, num_classes=2, class_counts=torch.ones(3, 2), rounds=4, clients_per_round=3,
                          seed=0, param_names=("w",))
    m = FedCross(FedCrossOptions(alpha=0.7, buffers=buffers), info)
    glob = {"w": torch.zeros(2), "bn.running_mean": torch.zeros(2)}
    state = m.round_start(m.server_init(glob, info), [0, 1, 2], 0)
    w = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.2])]
    rm = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0]), torch.tensor([7.0, 11.0])]
    uploads = [{"model.w": w[c], "model.bn.running_mean": rm[c]} for c in range(3)]
    reports = [ClientReport(client_id=c, num_samples=10, num_steps=1) for c in range(3)]
    _, out = m.aggregate(state, glob, uploads, reports)
    slot = state["cross.slot"].tolist()
    by_slot = {slot[c]: c for c in range(3)}  # the client whose trained model returned to slot j
    rows = [[w[by_slot[j]], rm[by_slot[j]]] for j in range(3)]
    sim = np.array([[layer_pair_similarity(rows[a], rows[b]) if a != b else 0.0 for b in range(3)] for a in range(3)])
    partner = [collaborator(sim, j, "lowest", 0) for j in range(3)]
    assert any(p < j for j, p in enumerate(partner))  # a pair where the two rules differ
    for j in range(3):
        torch.testing.assert_close(out["cross.models.w"][j], 0.7 * rows[j][0] + 0.3 * rows[partner[j]][0])
        expect = rows[min(j, partner[j])][1] if buffers == "pflib" else rows[j][1]
        torch.testing.assert_close(out["cross.models.bn.running_mean"][j], expect)


def test_fedcross_similarity_pairs_tensors_as_pflib_does():
    from fedskew.algorithms.methods.fedcross import collaborator, layer_pair_similarity

    x = [torch.tensor([1.0, 0.0]), torch.tensor([1.0]), torch.tensor([0.0, 2.0])]
    y = [torch.tensor([0.0, 1.0]), torch.tensor([1.0]), torch.tensor([1.0, 0.0])]
    # cos([1, 0, 1], [0, 1, 1]) = 1/2 for the pair, cos([0, 2], [1, 0]) = 0 for the single last tensor
    assert layer_pair_similarity(x, y) == pytest.approx(0.5)
    # two tensors: the pair, then the same pair again (PFLlib's trailing term)
    assert layer_pair_similarity(x[:2], y[:2]) == pytest.approx(1.0)
    sim = np.array([[0.0, 0.3, 0.1, 0.1], [0.3, 0.0, 0.5, 0.2], [0.1, 0.5, 0.0, 0.9], [0.1, 0.2, 0.9, 0.0]])
    assert [collaborator(sim, j, "lowest", 0) for j in range(4)] == [2, 3, 0, 0]  # ties: the first from j + 1
    assert [collaborator(sim, j, "highest", 0) for j in range(4)] == [1, 2, 3, 2]
    assert [collaborator(sim, j, "in_order", 4) for j in range(4)] == [2, 3, 0, 1]


def fedcac_reference(exp: Experiment, schedule: list[list[int]], tau: float, beta: int):
    """FedCAC (the authors' Fling code, re-derived in numpy): client k starts from
    g + m_k (u_k - g) (m_k its critical mask, u_k its customised model), trains, and marks the
    int(tau n) entries of each tensor with the largest |(y - start) y| critical; the server keeps
    FedAvg's mean g and, for each client of the round, u_k = the plain mean of the trained models
    whose masks overlap its own by 1 - |m_k - m_j|_1 / (2 |m_k|_1) >= mean + (t + 1) / beta (max - mean)."""
    fed, s = exp.fed, exp.executor.settings
    xs = [fed.data.x_train[i].double().numpy().reshape(len(i), -1) for i in fed.train_idx]
    ys = [fed.data.y_train[i].numpy() for i in fed.train_idx]
    n = np.array([len(y) for y in ys], dtype=float)
    init = {k: v.double().numpy() for k, v in exp.model.state_dict().items()}
    g = [init["classifier.weight"], init["classifier.bias"]]
    clients = range(len(ys))
    masks = {k: [np.zeros_like(g[0]), np.zeros_like(g[1])] for k in clients}
    custom = {k: [g[0].copy(), g[1].copy()] for k in clients}
    for t, selected in enumerate(schedule):
        trained = {}
        for k in selected:
            start = [g[i] + masks[k][i] * (custom[k][i] - g[i]) for i in range(2)]
            w = [start[0].copy(), start[1].copy()]
            for pos in batch_schedule(s, t, k, len(ys[k])):
                gw, gb = grad(w[0], w[1], xs[k][pos], ys[k][pos], 3)
                w = [w[0] - 0.1 * gw, w[1] - 0.1 * gb]
            trained[k] = w
            for i in range(2):
                c = np.abs((w[i] - start[i]) * w[i])
                masks[k][i] = (c >= np.sort(c.ravel())[::-1][int(tau * c.size) - 1]).astype(float)
        p = n[selected] / n[selected].sum()
        g = [sum(pk * trained[k][i] for pk, k in zip(p, selected)) for i in range(2)]
        flat = {k: np.concatenate([masks[k][0].ravel(), masks[k][1]]) for k in selected}
        ov = {(a, b): 1 - np.abs(flat[a] - flat[b]).sum() / (2 * flat[a].sum()) for a in selected for b in selected
              if a != b}
        mean, top = np.mean(list(ov.values())), max(ov.values())
        threshold = mean + (t + 1) / beta * (top - mean)
        for a in selected:
            peers = [a] + [b for b in selected if b != a and ov[a, b] >= threshold]
            custom[a] = [sum(trained[b][i] for b in peers) / len(peers) for i in range(2)]
    return g, custom


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_fedcac_matches_a_replay_of_the_authors_rules(tmp_path, executor):
    setup = [a for a in SETUP if not a.startswith(("partition.num_clients", "clients_per_round", "rounds"))]
    cfg = load_config(None, setup + ["partition.num_clients=4", "clients_per_round=4", "rounds=3", "method=fedcac",
                                     "method.tau=0.4", "method.beta=2", f"executor={executor}"])
    exp = Experiment(cfg, tmp_path / "probe")
    res = run(cfg, tmp_path / "run")
    g, custom = fedcac_reference(exp, [h["clients"] for h in res.history], 0.4, 2)
    np.testing.assert_allclose(res.global_state["classifier.weight"].double().numpy(), g[0], atol=2e-6)
    np.testing.assert_allclose(res.global_state["classifier.bias"].double().numpy(), g[1], atol=2e-6)
    kept = read_checkpoint(res.run_dir / "checkpoint.pt")["server_state"]
    for k in range(4):
        np.testing.assert_allclose(kept["cac.custom.classifier.weight"][k].double().numpy(), custom[k][0], atol=2e-6)
    # the threshold separated the clients: some customised models are not the mean of all four
    assert max(np.abs(custom[k][0] - np.mean([custom[j][0] for j in range(4)], 0)).max() for k in range(4)) > 1e-3


def fedem_reference(exp: Experiment, schedule: list[list[int]], m: int):
    """FedEM (Marfoq et al., Algorithm 1, re-derived in numpy) with M linear components: E-step
    q_i(m) = softmax_m(log pi_km - CE_m(x_i, y_i)) under the received components, pi_k <- mean_i q_i;
    M-step: SGD on the batch mean of sum_m q_i(m) CE_m; FedAvg of the components and of pi."""
    fed, s = exp.fed, exp.executor.settings
    xs = [fed.data.x_train[i].double().numpy().reshape(len(i), -1) for i in fed.train_idx]
    ys = [fed.data.y_train[i].numpy() for i in fed.train_idx]
    n = np.array([len(y) for y in ys], dtype=float)
    init = {k: v.double().numpy() for k, v in exp.model.state_dict().items()}
    comps = [[init[f"learners.{j}.classifier.weight"], init[f"learners.{j}.classifier.bias"]] for j in range(m)]
    pis = {k: np.full(m, 1 / m) for k in range(len(ys))}
    for t, selected in enumerate(schedule):
        trained = {}
        for k in selected:
            x, y = xs[k], ys[k]
            nll = np.stack([-np.log(softmax(x @ w.T + b)[np.arange(len(y)), y]) for w, b in comps], 1)
            q = softmax(np.log(pis[k])[None] - nll)
            pis[k] = q.mean(0)
            local = [[w.copy(), b.copy()] for w, b in comps]
            for pos in batch_schedule(s, t, k, len(y)):
                for j in range(m):
                    g = q[pos, j, None] * (softmax(x[pos] @ local[j][0].T + local[j][1]) - np.eye(3)[y[pos]]) / len(pos)
                    local[j] = [local[j][0] - 0.1 * g.T @ x[pos], local[j][1] - 0.1 * g.sum(0)]
            trained[k] = local
        p = n[selected] / n[selected].sum()
        comps = [[sum(pk * trained[k][j][i] for pk, k in zip(p, selected)) for i in range(2)] for j in range(m)]
        mix = sum(pk * pis[k] for pk, k in zip(p, selected))
    return comps, mix, pis


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_fedem_matches_a_replay_of_its_em_steps(tmp_path, executor):
    cfg = load_config(None, SETUP + ["method=fedem", "method.learners=2", f"executor={executor}"])
    exp = Experiment(cfg, tmp_path / "probe")
    res = run(cfg, tmp_path / "run")
    comps, mix, pis = fedem_reference(exp, [h["clients"] for h in res.history], 2)
    for j in range(2):
        np.testing.assert_allclose(res.global_state[f"learners.{j}.classifier.weight"].double().numpy(), comps[j][0],
                                   atol=2e-6)
        np.testing.assert_allclose(res.global_state[f"learners.{j}.classifier.bias"].double().numpy(), comps[j][1],
                                   atol=2e-6)
    np.testing.assert_allclose(res.global_state["classifier.mix"].double().numpy(), mix, atol=2e-6)
    states = read_checkpoint(res.run_dir / "checkpoint.pt")["client_states"]
    for k, st in states.items():
        np.testing.assert_allclose(st["em.pi"].double().numpy(), pis[int(k)], atol=2e-6)
    assert np.abs(mix - 0.5).max() > 1e-3  # the E-step moved the weights off uniform


def test_mixture_logits_are_the_log_of_the_mixed_probabilities():
    from fedskew.models.nets import MixtureHead

    head = MixtureHead(2)
    head.mix.copy_(torch.tensor([0.25, 0.75]))
    z = torch.tensor([[1.0, 0.0, 0.0, 2.0]])  # learner 0: (1, 0), learner 1: (0, 2)
    p = 0.25 * torch.softmax(torch.tensor([1.0, 0.0]), 0) + 0.75 * torch.softmax(torch.tensor([0.0, 2.0]), 0)
    torch.testing.assert_close(head(z)[0].exp(), p)


def _fedrepo_spread_steps(ws: torch.Tensor, margin: float, steps: int, lr: float) -> torch.Tensor:
    """A float64 port of lxcnju/FedRepo's FedAwS server step (algorithms/fedaws.py, SpreadModel and
    update_global_classifier, at 617ee015): an nn.Parameter of the classifier rows, torch.optim.SGD
    with momentum 0.9 built afresh, the loss over all C x C entries with the diagonal masked to 0."""
    param = torch.nn.Parameter(ws.clone())
    optimizer = torch.optim.SGD([param], lr=lr, momentum=0.9)
    for _ in range(steps):
        ws_norm = torch.nn.functional.normalize(param, dim=1)
        cos_dis = 0.5 * (1.0 - torch.mm(ws_norm, ws_norm.transpose(0, 1)))
        d_mat = torch.diag(torch.ones(param.shape[0], dtype=param.dtype))
        cos_dis = cos_dis * (1.0 - d_mat)
        indx = ((margin - cos_dis) > 0.0).to(param.dtype)
        loss = (((margin - cos_dis) * indx) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return param.detach()


@pytest.mark.parametrize("margin, steps, lr", [(0.8, 30, 0.1), (0.5, 50, 0.01)])  # FedRepo's two searched points
def test_fedaws_fedrepo_form_matches_a_float64_port_of_its_code(margin, steps, lr):
    from fedskew.algorithms.methods.fedaws import FedAwSOptions, server_steps

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(10, 16, generator=gen, dtype=torch.float64)
    ours = server_steps(w, FedAwSOptions(form="fedrepo", margin=margin, server_steps=steps, server_lr=lr))
    port = _fedrepo_spread_steps(w, margin, steps, lr)
    assert (ours - port).abs().max().item() < 1e-12
    # the paper's form differs: plain steps on the off-diagonal mean
    paper = server_steps(w, FedAwSOptions(form="paper", margin=margin, server_steps=steps, server_lr=lr))
    assert (paper - port).abs().max().item() > 1e-6


def test_fedaws_diagonal_form_is_the_off_diagonal_loss_rescaled_plus_a_constant():
    from fedskew.algorithms.methods.fedaws import spreadout

    w = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    c, m = 7, 0.6
    assert spreadout(w, m, diagonal=True).item() == pytest.approx(
        (spreadout(w, m).item() * c * (c - 1) + c * m * m) / (c * c), rel=1e-12)
