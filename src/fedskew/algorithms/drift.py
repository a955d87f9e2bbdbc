"""Client-drift baselines: FedProx, SCAFFOLD, FedCM, GHBM (with LocalGHBM and FedHBM), FedDyn, FedNova;
and sharpness-aware local steps, FedSAM and FedASAM (FedAvg + the ``sam`` component; the two passes
live in the executors' step).

Each is FedAvg with the pieces its paper changes. SCAFFOLD's and FedDC's control correction is a
step correction applied after each optimizer step, outside momentum (``Method.step_correction``);
the loss-term form (gradient of <c - c_i, theta>) stays as ``correction=loss``. Controls and dual variables cover the
trainable parameters (``info.param_names``); BatchNorm statistics are averaged as in FedAvg.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from fedskew.algorithms.base import (
    MODEL,
    FedAvgOptions,
    Method,
    Source,
    as_model_part,
    builtin,
    model_part,
    weighted_mean,
)
from fedskew.algorithms.components import SAMOptions, SharpnessAware
from fedskew.algorithms.compose import Composed, options_of


def _params(names, state, prefix=""):
    return {prefix + k: state[k] for k in names}


def _step_scale(weight: float, data, like: torch.Tensor) -> torch.Tensor:
    """weight / (lr K), K the client's local steps this round: the factor by which FedCM's and the GHBM
    family's official clients divide a round-level displacement added to every step's gradient
    (``_before_opt_step``); 0 at lr 0."""
    return torch.tensor(weight / (data.lr * max(data.steps, 1)) if data.lr > 0 else 0.0, dtype=like.dtype)


class FedProxOptions(FedAvgOptions):
    search = {'mu': [0.001, 0.01, 0.1]}  # the bench's search space (fedskew bench)
    mu: float = Field(0.01, ge=0, description="proximal weight")


@builtin
class FedProx(Method):
    """FedProx (Li et al., 2020, Eq. 2): CE + (mu/2) ||w - w^t||^2 over the trainable parameters,
    every batch. Sends and keeps what FedAvg does."""

    name = "fedprox"
    Options = FedProxOptions
    source = Source(
        authors="Li et al.",
        title="Federated Optimization in Heterogeneous Networks",
        venue="MLSys",
        year=2020,
        arxiv="1812.06127",
        implements="Eq. 2 (the proximal local objective)",
        code="litian96/FedProx")
    per_sample_loss = True  # Method.padding_exact

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
        prox = sum((p - payload["model." + k]).pow(2).sum() for k, p in params.items())
        return loss + 0.5 * self.opt.mu * prox, {**aux, "fedprox/prox": prox.detach()}


def effective_steps(tau: int, rho: float) -> float:
    """FedNova's a_i: how many plain-SGD steps tau steps with momentum rho amount to,
    [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho) (= tau when rho = 0)."""
    if rho == 0:
        return float(tau)
    return (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho)


def control_scale(report, mode: str) -> float:
    """1 / (steps * eta) in option II's control update c_i+ = c_i - c + (x - y) * scale. ``steps``
    (paper): tau local steps; ``momentum``: FedNova's effective steps a_i(tau, rho), so that with
    local momentum the control estimates the mean gradient instead of about 1/(1 - rho) times it."""
    steps = report.num_steps if mode == "steps" else effective_steps(report.num_steps, report.momentum)
    return 1.0 / (steps * report.lr)


Correction = Literal["after_step", "loss"]
CORRECTION_DOC = ("after_step: p -= lr (c - c_i) after each optimizer step, outside momentum and weight decay "
                  "(NIID-Bench; default); loss: the term <c - c_i, theta>, which passes through momentum")


class ScaffoldOptions(FedAvgOptions):
    search = {'server_lr': [0.5, 1.0]}  # the bench's search space (fedskew bench)
    server_lr: float = Field(1.0, gt=0, description="eta_g")
    control_steps: Literal["momentum", "steps"] = Field(
        "momentum", description="divide the control update by FedNova's momentum-aware a_i(tau, rho) (default; "
                                "= tau at momentum 0, the paper's plain SGD) or by tau")
    correction: Correction = Field("after_step", description=CORRECTION_DOC)


@builtin
class Scaffold(Method):
    """SCAFFOLD, option II (Karimireddy et al., 2020, Algorithm 1).

    Local step y <- y - eta (g(y) + c - c_i). Default (``correction=after_step``, as NIID-Bench
    does it): the optimizer steps on g(y) (with momentum and weight decay), then y <- y - eta (c -
    c_i) outside them (``step_correction``). ``correction=loss``: the loss term <c - c_i, y>, whose
    gradient is the correction; with momentum it goes through the momentum buffer and is
    over-applied about a_i/tau times (2.6-5.9x measured; NaN by round 4 on Fashion-MNIST P10C2).
    After tau_k steps: c_i+ = c_i - c + (x - y) / (a_k eta) (Eq. 4, option II), a_k = FedNova's
    effective step count a(tau_k, rho), which is tau_k for the paper's plain SGD; with momentum
    rho the model moves about 1/(1 - rho) times farther and tau_k would overestimate the mean
    gradient as much (``control_steps=steps``: tau_k; 33.4 vs 50.2 on Fashion-MNIST P10C2).
    Server: x <- x + eta_g sum_k p_k (y_k - x); c <- c + (1/N) sum_{k in S} (c_i+ - c_i) with N =
    all clients (adding c_i+ instead of the difference is a bug seen in another framework).

    Down: |theta| + |params| (model, c). Up: |theta| + |params| (model, c_i+ - c_i).
    Client keeps c_i (|params|); server keeps c (|params|).
    """

    name = "scaffold"
    Options = ScaffoldOptions
    source = Source(
        authors="Karimireddy et al.",
        title="SCAFFOLD: Stochastic Controlled Averaging for Federated Learning",
        venue="ICML",
        year=2020,
        arxiv="1910.06378",
        implements="Algorithm 1 with option II control variates",
        code="no official code; the paper's Algorithm 1")
    per_sample_loss = True  # Method.padding_exact

    def server_init(self, global_state, info):
        return {k: torch.zeros_like(v) for k, v in _params(info.param_names, global_state, "c.").items()}

    def client_init(self, client_id, global_state, info):
        return {k: torch.zeros_like(v) for k, v in _params(info.param_names, global_state, "ci.").items()}

    def broadcast(self, global_state, server_state):
        return {**as_model_part(global_state), **server_state}

    def _direction(self, payload, client_state):
        return {k: payload["c." + k] - client_state["ci." + k] for k in self.info.param_names}

    def step_correction(self, payload, client_state):
        return self._direction(payload, client_state) if self.opt.correction == "after_step" else None

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
        if self.opt.correction == "loss":
            d = self._direction(payload, client_state)
            loss = loss + sum((d[k] * p).sum() for k, p in params.items())
        return loss, aux

    def after_training(self, trained, payload, client_state, report):
        scale = control_scale(report, self.opt.control_steps)
        new_ci, delta = {}, {}
        for k in self.info.param_names:
            ci = client_state["ci." + k]
            new_ci["ci." + k] = ci - payload["c." + k] + (payload["model." + k] - trained[k]) * scale
            delta["dc." + k] = new_ci["ci." + k] - ci
        return {**as_model_part(trained), **delta}, new_ci

    def aggregate(self, server_state, global_state, uploads, reports):
        mean = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        params = set(self.info.param_names)
        new = {k: x + self.opt.server_lr * (mean[k] - x) if k in params else mean[k]
               for k, x in global_state.items()}
        n = self.info.num_clients
        c = {key: v + sum(u["d" + key] for u in uploads) / n for key, v in server_state.items()}
        return new, c


class FedCMOptions(FedAvgOptions):
    search = {"alpha": [0.05, 0.1, 0.3]}  # the bench's search space (fedskew bench)
    alpha: float = Field(0.1, gt=0, lt=1, description="weight of the local gradient: each step follows alpha g + "
                                                      "(1 - alpha) Delta / (lr K)")


@builtin
class FedCM(Method):
    """FedCM (Xu et al., 2021, Algorithm 1): client-level momentum. Every local step follows
    alpha g + (1 - alpha) Delta / (lr K), with Delta the last round's global pseudo-gradient
    x_{t-1} - x_t (zero in round 1) and K the client's local steps this round (the official
    implementation's ``_before_opt_step``, which divides on the client by its own lr and step count;
    Algorithm 1 divides on the server by a common lr K). Written as the loss alpha CE + (1 - alpha)
    <Delta, w> / (lr K), whose gradient is that direction before weight decay and clipping, as the
    official client modifies the gradient before its optimizer step and its clipping. The server
    averages as FedAvg (server lr 1) and keeps Delta = x - sum_k p_k theta_k over the trainable
    parameters."""

    @classmethod
    def inert(cls, options, rounds, num_clients, clients_per_round):
        if options.alpha < 1e-6:
            return (f"alpha = {options.alpha:g} weighs the local gradient by under 1e-6: round 1's steps are alpha "
                    f"times FedAvg's and the momentum is what they moved, so nothing trains")

    name = "fedcm"
    own_optimiser = True  # (Method.own_optimiser)
    Options = FedCMOptions
    source = Source(authors="Xu, Wang, Wang, Yao", title="FedCM: Federated Learning with Client-level Momentum",
                    venue="arXiv preprint", year=2021, arxiv="2106.10874",
                    implements="Algorithm 1 (client-level momentum)",
                    code="RickZack/GHBM src/algo/fed_clients/fedcm_client.py, center_server/fedcm_center_server.py "
                         "(the GHBM authors' FedCM, a Flower-baselines reference)")
    per_sample_loss = True  # Method.padding_exact
    # the official client (GHBM config/algo/optim/sgd.yaml): SGD lr 0.1, no momentum (FedCM's is its
    # own), weight decay 1e-4; at fedskew's lr 0.01 without momentum it trains ten times slower
    run_defaults = {"lr": 0.1, "momentum": 0.0, "weight_decay": 1e-4}

    def server_init(self, global_state, info):
        return {k: torch.zeros_like(v) for k, v in _params(info.param_names, global_state, "delta.").items()}

    def broadcast(self, global_state, server_state):
        return {**as_model_part(global_state), **server_state}

    def prepare(self, payload, client_state, data):
        return {**client_state, "fedcm.scale": _step_scale(1 - self.opt.alpha, data,
                                                           payload["delta." + self.info.param_names[0]])}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
        pull = sum((payload["delta." + k] * p).sum() for k, p in params.items())
        return self.opt.alpha * loss + client_state["fedcm.scale"] * pull, aux

    def after_training(self, trained, payload, client_state, report):
        return as_model_part(trained), {k: v for k, v in client_state.items() if k != "fedcm.scale"}

    def aggregate(self, server_state, global_state, uploads, reports):
        mean = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        return mean, {"delta." + k: global_state[k] - mean[k] for k in self.info.param_names}


class GHBMOptions(FedAvgOptions):
    search = {"beta": [0.5, 0.9, 0.99]}  # the bench's search space (fedskew bench)
    beta: float = Field(0.9, ge=0, lt=1, description="momentum weight: each step adds beta m / (lr K)")
    tau: int | None = Field(None, ge=1, description="rounds the momentum spans (default: the inverse participation, "
                                                    "round(num_clients / clients_per_round), the paper's choice)")


@builtin
class GHBM(Method):
    """GHBM (Zaccone, Karimireddy, Masone, Ciccone, TMLR 2025, Algorithm 1, non-Nesterov form):
    generalized heavy-ball momentum. The server keeps its last tau models and broadcasts
    m = (x_{t+1-tau} - x_{t+1}) / tau, the mean displacement over tau rounds (none before tau
    rounds; tau = 1 is classical server momentum); every local step adds beta m / (lr K) to the
    gradient, K the client's local steps (the authors' ``_before_opt_step``), written as the loss
    CE + beta <m, w> / (lr K). The server averages as FedAvg (server lr 1). tau defaults to the
    inverse participation ratio, with which the paper's analysis removes the effect of client
    heterogeneity under partial participation."""

    name = "ghbm"
    own_optimiser = True
    Options = GHBMOptions
    source = Source(
        authors="Zaccone, Karimireddy, Masone, Ciccone",
        title="Communication-Efficient Heterogeneous Federated Learning with Generalized Heavy-Ball Momentum",
        venue="TMLR",
        year=2025,
        arxiv="2311.18578",
        implements="Algorithm 1 (GHBM, non-Nesterov)",
        code="RickZack/GHBM src/algo/fed_clients/ghbm_client.py, center_server/ghbm_center_server.py, "
        "config/algo/ghbm.yaml",
    )
    per_sample_loss = True  # Method.padding_exact
    # the official client (config/algo/optim/sgd.yaml): SGD lr 0.1, no momentum, weight decay 1e-4
    run_defaults = {"lr": 0.1, "momentum": 0.0, "weight_decay": 1e-4}

    @property
    def tau(self) -> int:
        info = self.info
        return self.opt.tau or max(1, round(info.num_clients / max(info.clients_per_round, 1)))

    @classmethod
    def inert(cls, options, rounds, num_clients, clients_per_round):
        tau = options.tau or max(1, round(num_clients / max(clients_per_round, 1)))
        if tau >= rounds:
            return (f"tau = {tau} is not below rounds = {rounds}: the momentum needs tau rounds of models, so none "
                    f"exists in this run and it is FedAvg")

    def server_init(self, global_state, info):
        return {**{k: torch.zeros_like(v) for k, v in _params(info.param_names, global_state, "m.").items()},
                "past": torch.zeros((), dtype=torch.long)}

    def broadcast(self, global_state, server_state):
        return {**as_model_part(global_state), **{k: v for k, v in server_state.items() if k.startswith("m.")}}

    def prepare(self, payload, client_state, data):
        return {**client_state, "ghbm.scale": _step_scale(self.opt.beta, data,
                                                          payload["model." + self.info.param_names[0]])}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
        pull = sum((payload["m." + k] * p).sum() for k, p in params.items())
        return loss + client_state["ghbm.scale"] * pull, aux

    def after_training(self, trained, payload, client_state, report):
        return as_model_part(trained), {k: v for k, v in client_state.items() if k != "ghbm.scale"}

    def aggregate(self, server_state, global_state, uploads, reports):
        names, tau = self.info.param_names, self.tau
        mean = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        # the queue of the last tau models before aggregation (oldest first): x_{t+1-tau} .. x_t
        queue = [{k: server_state[f"past{i}.{k}"] for k in names} for i in range(int(server_state["past"]))]
        queue = (queue + [{k: global_state[k] for k in names}])[-tau:]
        state = {f"past{i}.{k}": q[k] for i, q in enumerate(queue) for k in names}
        state["past"] = torch.tensor(len(queue))
        full = len(queue) >= tau
        state.update({"m." + k: (queue[0][k] - mean[k]) / tau if full else torch.zeros_like(mean[k]) for k in names})
        return mean, state


class LocalGHBMOptions(FedAvgOptions):
    search = {"beta": [0.5, 0.9, 0.99]}  # the bench's search space (fedskew bench)
    beta: float = Field(0.9, ge=0, description="momentum weight: each step adds beta m / (lr K)")
    participation: float | None = Field(
        None, gt=0, le=1, description="C, the factor of the client's displacement (default: clients_per_round / "
                                      "num_clients, the official configs' participation ratio)")


class FedHBMOptions(LocalGHBMOptions):
    search = {"beta": [0.5, 0.9, 1.0]}  # the bench's search space (fedskew bench)
    beta: float = Field(1.0, ge=0, description="momentum weight: each step adds beta m / (lr K) (the official "
                                               "config's 1)")


@builtin
class LocalGHBM(Method):
    """LocalGHBM (Zaccone et al., TMLR 2025, Sec. 4, the communication-efficient GHBM): GHBM's
    momentum from what the client itself saw, so nothing but the model travels. The client keeps
    the model it received when it last took part (its anchor a_i); this round's momentum is
    m = C (a_i - x_t), C the participation ratio standing for 1 / tau, zero at its first round
    (the official ``LocalGHBMClient._set_momentum``), and every local step adds beta m / (lr K) to
    the gradient, as GHBM (written as the loss CE + beta <m, w> / (lr K)). Afterwards the anchor
    becomes x_t. The server averages as FedAvg."""

    name = "localghbm"
    own_optimiser = True
    Options = LocalGHBMOptions
    source = Source(
        authors="Zaccone, Karimireddy, Masone, Ciccone",
        title="Communication-Efficient Heterogeneous Federated Learning with Generalized Heavy-Ball Momentum",
        venue="TMLR",
        year=2025,
        arxiv="2311.18578",
        implements="Sec. 4, LocalGHBM (the client's anchor: the model it last received)",
        code="RickZack/GHBM src/algo/fed_clients/ghbm_client.py (LocalGHBMClient, variant standard), "
        "config/algo/localghbm.yaml",
    )
    per_sample_loss = True  # Method.padding_exact
    run_defaults = GHBM.run_defaults

    def client_init(self, client_id, global_state, info):
        anchor = {k: torch.zeros_like(v) for k, v in _params(info.param_names, global_state, "anchor.").items()}
        return {**anchor, "anchor.seen": torch.zeros((), dtype=next(iter(anchor.values())).dtype)}

    def prepare(self, payload, client_state, data):
        info = self.info
        c = self.opt.participation or info.clients_per_round / info.num_clients
        scale = _step_scale(self.opt.beta * c, data, client_state["anchor.seen"]) * client_state["anchor.seen"]
        return {**client_state, "ghbm.scale": scale}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
        pull = sum(((client_state["anchor." + k] - payload[MODEL + k]) * p).sum() for k, p in params.items())
        return loss + client_state["ghbm.scale"] * pull, aux

    def next_anchor(self, trained, payload):
        """The anchor the client keeps for its next round: the model it received (LocalGHBM)."""
        return model_part(payload)

    def after_training(self, trained, payload, client_state, report):
        new = self.next_anchor(trained, payload)
        state = {**{"anchor." + k: new[k] for k in self.info.param_names},
                 "anchor.seen": torch.ones_like(client_state["anchor.seen"])}
        return as_model_part(trained), state


@builtin
class FedHBM(LocalGHBM):
    """FedHBM (Zaccone et al., TMLR 2025, Sec. 4): LocalGHBM whose anchor is the model the client
    itself trained when it last took part, and whose momentum follows the model being trained:
    step s adds beta C (a_i - w_s) / (lr K) to the gradient (the official ``FedHBMClient`` recomputes
    the momentum before every step), the gradient of the loss term -beta C ||a_i - w||^2 / (2 lr K);
    zero at the client's first round. beta is 1 in the official config."""

    name = "fedhbm"
    Options = FedHBMOptions
    source = Source(
        authors="Zaccone, Karimireddy, Masone, Ciccone",
        title="Communication-Efficient Heterogeneous Federated Learning with Generalized Heavy-Ball Momentum",
        venue="TMLR",
        year=2025,
        arxiv="2311.18578",
        implements="Sec. 4, FedHBM (the client's anchor: the model it last trained)",
        code="RickZack/GHBM src/algo/fed_clients/ghbm_client.py (FedHBMClient, variant standard), "
        "config/algo/fedhbm.yaml",
    )
    per_sample_loss = True  # Method.padding_exact

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = Method.local_loss(self, fwd, params, x, y, payload, client_state)
        spread = sum(((client_state["anchor." + k] - p) ** 2).sum() for k, p in params.items())
        return loss - client_state["ghbm.scale"] / 2 * spread, aux

    def next_anchor(self, trained, payload):
        """The model the client trained this round (FedHBM)."""
        return trained


class FedDynOptions(FedAvgOptions):
    search = {'alpha': [0.001, 0.01, 0.1]}  # the bench's search space (fedskew bench)
    alpha: float = Field(0.01, gt=0, description="weight of FedDyn's dynamic regulariser (the same alpha "
                                                  "updates the server's h)")
    alpha_by_data: bool = Field(False, description="reference code: alpha_k = alpha / (n_k / mean n)")


@builtin
class FedDyn(Method):
    """FedDyn (Acar et al., 2021, Algorithm 1).

    Client k keeps g_k (starts at 0). Local objective CE(theta) - <g_k, theta>
    + (alpha/2) ||theta - theta^{t-1}||^2; after training g_k <- g_k - alpha (theta_k - theta^{t-1}).
    Server keeps h (starts at 0): h <- h - alpha (1/m) sum_{k in S} (theta_k - theta^{t-1}), m = all
    clients; theta^t = (1/|S|) sum_{k in S} theta_k - h / alpha (unweighted mean, as in the paper;
    BatchNorm statistics: unweighted mean).

    Down |theta|, up |theta|; client state g_k (|params|), server state h (|params|).
    """

    fedavg_weighted = False  # uniform mean plus h (Method.fedavg_weighted)

    name = "feddyn"
    Options = FedDynOptions
    source = Source(
        authors="Acar et al.",
        title="Federated Learning Based on Dynamic Regularization",
        venue="ICLR",
        year=2021,
        arxiv="2111.04263",
        implements="Algorithm 1 (the dynamic regulariser and the server's h state)",
        code="alpemreacar/FedDyn")
    per_sample_loss = True  # Method.padding_exact

    def server_init(self, global_state, info):
        return {k: torch.zeros_like(v) for k, v in _params(info.param_names, global_state, "h.").items()}

    def client_init(self, client_id, global_state, info):
        state = {k: torch.zeros_like(v) for k, v in _params(info.param_names, global_state, "g.").items()}
        alpha = self.opt.alpha
        if self.opt.alpha_by_data:
            sizes = info.class_counts.sum(1).double()
            alpha = alpha / float(sizes[client_id] / sizes.mean())
        device = global_state[info.param_names[0]].device
        state["alpha"] = torch.tensor(alpha, dtype=torch.float32, device=device)
        return state

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
        linear = sum((client_state["g." + k] * p).sum() for k, p in params.items())
        prox = sum((p - payload["model." + k]).pow(2).sum() for k, p in params.items())
        return loss - linear + 0.5 * client_state["alpha"] * prox, aux

    def after_training(self, trained, payload, client_state, report):
        alpha = client_state["alpha"]
        new = {"g." + k: client_state["g." + k] - alpha * (trained[k] - payload["model." + k])
               for k in self.info.param_names}
        new["alpha"] = alpha
        return as_model_part(trained), new

    def aggregate(self, server_state, global_state, uploads, reports):
        a, m = self.opt.alpha, self.info.num_clients
        uniform = torch.full((len(uploads),), 1.0 / len(uploads), dtype=torch.float64)
        mean = weighted_mean([model_part(u) for u in uploads], uniform)
        h = {key: v - a * (mean[key[2:]] - global_state[key[2:]]) * len(uploads) / m
             for key, v in server_state.items()}
        new = {k: mean[k] - h["h." + k] / a if ("h." + k) in h else mean[k] for k in global_state}
        return new, h


@builtin
class FedNova(Method):
    """FedNova (Wang et al., 2020): normalised averaging.

    a_i = [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho) for local SGD momentum rho
    (a_i = tau_i when rho = 0); d_i = (x - y_i) / a_i; p_i = n_i / sum n;
    x <- x - (sum_i p_i a_i) sum_i p_i d_i. BatchNorm statistics: sample-weighted mean.
    Sends and keeps what FedAvg does.
    """

    fedavg_weighted = False  # normalised averaging (Method.fedavg_weighted)

    name = "fednova"
    Options = FedAvgOptions
    source = Source(
        authors="Wang, Liu, Liang, Joshi, Poor",
        title="Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization",
        venue="NeurIPS",
        year=2020,
        arxiv="2007.07481",
        implements="normalised averaging of the local updates (Eq. 6-7)",
        code="JYWa/FedNova")

    a_i = staticmethod(effective_steps)

    def aggregate(self, server_state, global_state, uploads, reports):
        n = torch.tensor([r.num_samples for r in reports], dtype=torch.float64)
        p = n / n.sum()
        a = torch.tensor([self.a_i(r.num_steps, r.momentum) for r in reports], dtype=torch.float64)
        models = [model_part(u) for u in uploads]
        mean = weighted_mean(models, p)
        params = set(self.info.param_names)
        tau_eff = float((p * a).sum())
        new = {}
        for k, x in global_state.items():
            if k not in params:
                new[k] = mean[k]
                continue
            d = sum(float(p[i] / a[i]) * (x - models[i][k]) for i in range(len(models)))
            new[k] = x - tau_eff * d
        return new, server_state


class FedDCOptions(FedAvgOptions):
    search = {'alpha': [0.001, 0.01, 0.1]}  # the bench's search space (fedskew bench)
    alpha: float = Field(0.01, gt=0, description="weight of the drift-decoupled proximal term")
    aggregation: Literal["code", "paper"] = Field(
        "code", description="code: mean_S theta_i + mean over all clients of h_i (official code, default); "
                            "paper: mean_S(theta_i + h_i)")
    by_data_size: bool = Field(True, description="official code: client weight w_i = n_i / mean n; alpha_i = "
                                                 "alpha / w_i, correction c / w_i - c_i, control deltas x w_i")
    control_steps: Literal["fixed", "steps", "momentum"] = Field(
        "fixed", description="divide the control update by a(E * ceil(mean n / B), rho) (official code's fixed count, "
                             "made momentum-aware; default), by the client's own tau, or by a(tau, rho)")
    correction: Correction = Field("after_step", description=CORRECTION_DOC)


@builtin
class FedDC(Method):
    """FedDC (Gao et al., CVPR 2022): local drift decoupling and correction; defaults follow the
    official code (gaoliang13/FedDC, ``train_FedDC``), which produced the paper's tables.

    Client i keeps its drift h_i and a SCAFFOLD-style control c_i; the server keeps c. With the
    client weight w_i = n_i / mean_k n_k (``by_data_size``; 1 otherwise):
    local objective CE(theta) + (alpha / w_i / 2) ||theta - (w - h_i)||^2 + <theta, c / w_i - c_i>,
    the last term applied as a step correction (``correction=after_step``: p -= lr (c / w_i - c_i)
    after each optimizer step, outside momentum; the official code uses plain SGD, where both
    forms agree). After training: h_i <- h_i + (theta_i - w); c_i+ = c_i - c / w_i + (w - theta_i)
    / (a(S, rho) eta) with the official code's fixed step count S = E * ceil(mean n / B) and
    FedNova's a(S, rho) (= S at rho = 0, the official code's plain SGD; with momentum 0.9 the raw
    S over-estimates the gradient tenfold and FedDC falls to chance on Fashion-MNIST P10C2);
    c <- c + (1/N) sum_S w_i (c_i+ - c_i), N = all clients.
    Server model: ``code``: w <- mean_S theta_i + (1/N) sum over all clients of h_i (the server
    tracks that mean, updating it with theta_i - w, so nothing more is sent); ``paper``: w <- mean
    over selected of (theta_i + h_i) (the client uploads the sum).

    Down |theta| + |params| (model, c); up |theta| + |params| (model or model + drift, w_i (c_i+ - c_i)).
    Client keeps h_i, c_i and w_i (2 |params| + 1); server keeps c (and the mean drift in ``code``).
    """

    fedavg_weighted = False  # uniform mean plus drift (Method.fedavg_weighted)

    name = "feddc"
    Options = FedDCOptions
    source = Source(
        authors="Gao et al.",
        title="FedDC: Federated Learning with Non-IID Data via Local Drift Decoupling and Correction",
        venue="CVPR",
        year=2022,
        arxiv="2203.11751",
        implements="Eq. 6-9 and Algorithm 1 (drift variable, penalised local objective, corrected upload)",
        code="gaoliang13/FedDC")
    per_sample_loss = True  # Method.padding_exact

    def server_init(self, global_state, info):
        state = {k: torch.zeros_like(v) for k, v in _params(info.param_names, global_state, "c.").items()}
        if self.opt.aggregation == "code":
            state.update({k: torch.zeros_like(v) for k, v in _params(info.param_names, global_state, "hbar.").items()})
        return state

    def client_init(self, client_id, global_state, info):
        zeros = {k: torch.zeros_like(v) for k, v in _params(info.param_names, global_state).items()}
        sizes = info.class_counts.sum(1).double()
        weight = float(sizes[client_id] / sizes.mean()) if self.opt.by_data_size else 1.0
        ref = global_state[info.param_names[0]]
        return {**{"h." + k: v for k, v in zeros.items()}, **{"ci." + k: v.clone() for k, v in zeros.items()},
                "w": torch.tensor(weight, dtype=ref.dtype, device=ref.device)}

    def broadcast(self, global_state, server_state):
        return {**as_model_part(global_state), **{k: v for k, v in server_state.items() if k.startswith("c.")}}

    def _direction(self, payload, client_state):
        return {k: payload["c." + k] / client_state["w"] - client_state["ci." + k] for k in self.info.param_names}

    def step_correction(self, payload, client_state):
        return self._direction(payload, client_state) if self.opt.correction == "after_step" else None

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
        prox = sum((p + client_state["h." + k] - payload["model." + k]).pow(2).sum() for k, p in params.items())
        loss = loss + 0.5 * self.opt.alpha / client_state["w"] * prox
        if self.opt.correction == "loss":
            d = self._direction(payload, client_state)
            loss = loss + sum((d[k] * p).sum() for k, p in params.items())
        return loss, aux

    def _control_scale(self, report) -> float:
        if self.opt.control_steps != "fixed":
            return control_scale(report, self.opt.control_steps)
        info = self.info
        mean_n = float(info.class_counts.sum(1).double().mean())
        fixed = info.local_epochs * math.ceil(mean_n / info.batch_size)
        return 1.0 / (effective_steps(fixed, report.momentum) * report.lr)

    def after_training(self, trained, payload, client_state, report):
        scale = self._control_scale(report)
        w = client_state["w"]
        state, upload = {"w": w}, as_model_part(trained)
        for k in self.info.param_names:
            g, theta = payload["model." + k], trained[k]
            h = client_state["h." + k] + (theta - g)
            ci = client_state["ci." + k]
            new_ci = ci - payload["c." + k] / w + (g - theta) * scale
            state["h." + k], state["ci." + k] = h, new_ci
            upload["dc." + k] = (new_ci - ci) * w
            if self.opt.aggregation == "paper":
                upload["model." + k] = theta + h
        return upload, state

    def aggregate(self, server_state, global_state, uploads, reports):
        n = self.info.num_clients
        uniform = torch.full((len(uploads),), 1.0 / len(uploads), dtype=torch.float64)
        mean = weighted_mean([model_part(u) for u in uploads], uniform)
        state = {key: v + sum(u["d" + key] for u in uploads) / n
                 for key, v in server_state.items() if key.startswith("c.")}
        if self.opt.aggregation == "code":
            for k in self.info.param_names:
                hbar = server_state["hbar." + k] + sum(model_part(u)[k] - global_state[k] for u in uploads) / n
                state["hbar." + k] = hbar
                mean[k] = mean[k] + hbar
        return mean, state


# ---------------------------------------------------------------------------------------------
# FedSAM, FedASAM


class FedSAMOptions(SAMOptions, FedAvgOptions):
    pass


class FedASAMOptions(FedSAMOptions):
    rho: float = Field(0.7, gt=0, description="radius of the ascent step; FedASAM's official CIFAR-10 script: 0.7")
    adaptive: bool = Field(True, description="ASAM's scale-invariant radius T = |w| + eta (FedASAM)")
    search = {'rho': [0.3, 0.7, 1.0]}  # the bench's search space (fedskew bench)


@builtin
class FedSAM(Composed):
    """FedSAM (Qu et al., ICML 2022; Caldarola et al., ECCV 2022): FedAvg whose local steps are
    SAM steps (:class:`~fedskew.algorithms.components.SharpnessAware`); any other method takes
    them as ``method.sam.rho=0.1``. Two forward-backward passes per step; sends and keeps what
    FedAvg does."""

    name = "fedsam"
    Options = FedSAMOptions
    source = Source(
        authors="Caldarola, Caputo, Ciccone; Qu et al. (ICML 2022) named it too",
        title="Improving Generalization in Federated Learning by Seeking Flat Minima",
        venue="ECCV",
        year=2022,
        arxiv="2203.11834",
        implements="SAM local steps (the paper's Section 4)",
        code="debcaldarola/fedsam")

    def parts(self, opt):
        return [SharpnessAware(options_of(SAMOptions, opt))]


@builtin
class FedASAM(FedSAM):
    """FedASAM (Caldarola et al., ECCV 2022): FedSAM with ASAM's adaptive radius (rho 0.7, eta 0.2
    as the official CIFAR-10 script)."""

    name = "fedasam"
    Options = FedASAMOptions
    source = Source(
        authors="Caldarola, Caputo, Ciccone",
        title="Improving Generalization in Federated Learning by Seeking Flat Minima",
        venue="ECCV",
        year=2022,
        arxiv="2203.11834",
        implements="ASAM local steps (adaptive radius, the paper's Section 4)",
        code="debcaldarola/fedsam")
