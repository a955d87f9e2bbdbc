"""Server optimisers: FedAvgM, FedAdagrad, FedAdam, FedYogi (Reddi et al., 2021, "Adaptive
Federated Optimization", Algorithm 2; FedAvgM: Hsu et al., 2019), and FedExP's extrapolated server
step (Jhunjhunwala et al., 2023).

Pseudo-gradient Delta = sum_k p_k theta_k - x (FedAvg weights p_k). Then
- FedAvgM: m <- beta m + Delta; x <- x + eta_g m.
- FedAdam: m <- b1 m + (1 - b1) Delta; v <- b2 v + (1 - b2) Delta^2; x <- x + eta_g m / (sqrt(v) + tau).
- FedYogi: as FedAdam but v <- v - (1 - b2) Delta^2 sign(v - Delta^2).
- FedAdagrad: as FedAdam but v <- v + Delta^2; b1 = 0 by default (no server momentum, as Flower's
  FedAdagrad; b1 > 0 is Algorithm 2's momentum).
No bias correction (Reddi et al.); v starts at tau^2 (their v_{-1} >= tau^2), m at 0. This is not torch.optim.Adam. With
tau = 1e-3 the first adaptive step is about eta_g * sign(Delta) per coordinate (|step| <= eta_g (1 - b1) / sqrt(1 - b2)
= eta_g), so eta_g = 1 moves every weight by about 1 and diverges at once; Reddi et al. tune eta_g in 1e-3..1e-1.
Default 0.01: on Fashion-MNIST P10C2 (docs/benchmarks.md) 0.1 stays at chance and 0.01 trains above FedAvg. Only
trainable parameters are optimised; BatchNorm statistics take the weighted mean. Communication as FedAvg; the server
keeps m (and v).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin, model_part, weighted_mean
from fedskew.algorithms.components import DiscoOptions, Discrepancy
from fedskew.algorithms.compose import Composed, options_of

REDDI = dict(authors="Reddi et al.", title="Adaptive Federated Optimization", venue="ICLR", year=2021,
             arxiv="2003.00295", code="google-research/federated (the paper's reference)")


class FedAvgMOptions(FedAvgOptions):
    """FedAvgM reads eta_g and its momentum only (no second moment, no tau)."""
    search = {'server_lr': [0.3, 1.0], 'beta1': [0.7, 0.9]}  # the bench's search space (fedskew bench)

    server_lr: float = Field(1.0, gt=0, description="eta_g")
    beta1: float = Field(0.9, ge=0, lt=1, description="server momentum beta: m <- beta m + Delta")


class AdaptiveOptions(FedAvgOptions):
    search = {'server_lr': [0.003, 0.01, 0.03]}  # the bench's search space (fedskew bench)
    server_lr: float = Field(0.01, gt=0, description="eta_g (Reddi et al. tune 1e-3..1e-1; 1.0 diverges)")
    beta1: float = Field(0.9, ge=0, lt=1, description="first-moment decay")
    beta2: float = Field(0.99, ge=0, lt=1, description="second-moment decay")
    tau: float = Field(1e-3, gt=0, description="adaptivity; v starts at tau^2")


class AdagradOptions(FedAvgOptions):
    """FedAdagrad has no second-moment decay: v accumulates every Delta^2."""
    search = {'server_lr': [0.003, 0.01, 0.03]}  # the bench's search space (fedskew bench)
    server_lr: float = Field(0.01, gt=0, description="eta_g (Reddi et al. tune 1e-3..1e-1)")
    beta1: float = Field(0.0, ge=0, lt=1, description="first-moment decay (0: no server momentum, Flower's "
                                                      "FedAdagrad; Algorithm 2 allows any)")
    tau: float = Field(1e-3, gt=0, description="adaptivity; v starts at tau^2")


class ServerOpt(Method):
    """A server optimiser over the pseudo-gradient (module docstring)."""

    kind: Literal["avgm", "adagrad", "adam", "yogi"] = "avgm"
    Options: type[FedAvgOptions] = FedAvgMOptions

    def server_init(self, global_state, info):
        state = {"m." + k: torch.zeros_like(global_state[k]) for k in info.param_names}
        if self.kind != "avgm":
            state.update({"v." + k: torch.full_like(global_state[k], self.opt.tau ** 2) for k in info.param_names})
        return state

    def aggregate(self, server_state, global_state, uploads, reports):
        o = self.opt
        mean = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        new, state = dict(mean), {}
        for k in self.info.param_names:
            delta = mean[k] - global_state[k]
            m = server_state["m." + k]
            if self.kind == "avgm":
                m = o.beta1 * m + delta
                new[k] = global_state[k] + o.server_lr * m
            else:
                m = o.beta1 * m + (1 - o.beta1) * delta
                v, d2 = server_state["v." + k], delta.pow(2)
                if self.kind == "adagrad":
                    v = v + d2
                elif self.kind == "adam":
                    v = o.beta2 * v + (1 - o.beta2) * d2
                else:
                    v = v - (1 - o.beta2) * d2 * torch.sign(v - d2)
                state["v." + k] = v
                new[k] = global_state[k] + o.server_lr * m / (v.sqrt() + o.tau)
            state["m." + k] = m
        return new, state


@builtin
class FedAvgM(ServerOpt):
    """FedAvgM (Hsu et al., 2019): server momentum over the pseudo-gradient, m <- beta m + Delta."""
    source = Source(
        authors="Hsu, Qi, Brown",
        title="Measuring the Effects of Non-Identical Data Distribution for Federated Visual Classification",
        venue="arXiv preprint",
        year=2019,
        arxiv="1909.06335",
        implements="server momentum on the pseudo-gradient (Section 3)",
        code="no official code; the paper's server momentum")

    name, kind = "fedavgm", "avgm"


@builtin
class FedAdagrad(ServerOpt):
    """FedAdagrad (Reddi et al., 2021, Algorithm 2): Adagrad on the server, v <- v + Delta^2."""
    source = Source(**REDDI, implements="Algorithm 2 (FedAdagrad)")

    name, kind, Options = "fedadagrad", "adagrad", AdagradOptions


@builtin
class FedAdam(ServerOpt):
    """FedAdam (Reddi et al., 2021, Algorithm 2): Adam on the server, no bias correction."""
    source = Source(**REDDI, implements="Algorithm 2 (FedAdam)")

    name, kind, Options = "fedadam", "adam", AdaptiveOptions


@builtin
class FedYogi(ServerOpt):
    """FedYogi (Reddi et al., 2021, Algorithm 2): Yogi's additive second-moment update on the server."""
    source = Source(**REDDI, implements="Algorithm 2 (FedYogi)")

    name, kind, Options = "fedyogi", "yogi", AdaptiveOptions


class FedExPOptions(FedAvgOptions):
    """FedExP's step size reads epsilon; the official code scales it by the clients of the round."""
    search = {"epsilon": [1e-3, 1e-2, 1e-1]}  # the bench's search space (fedskew bench)
    epsilon: float = Field(
        1e-3,
        gt=0,
        allow_inf_nan=False,
        description="eps of eta_g's denominator (official code: CIFAR-10/100 and CINIC-10 0.001, EMNIST 0.1)",
    )
    epsilon_scale: Literal["clients", "paper"] = Field(
        "clients", description="clients: the official code's ||Delta||^2 + |S| eps; paper: + eps")
    eval_average: bool = Field(True, description="score the mean of the last two global models (the official "
                                                 "code's net_eval; training goes on from the last)")
    schedule: Literal["official", "constant"] = Field(
        "official", description="official: in round t (from 0) the local lr is lr 0.998^(t+1) and epsilon is "
                                "epsilon 0.998^(2(t+1)) (the official main.py decays both at the top of every round); "
                                "constant: both as given")
    local_steps: int = Field(0, ge=0, le=10 ** 6, description="local steps per round, whatever the client's size "
                                                              "(the official code's cp: 20); 0: the run's E epochs")


@builtin
class FedExP(Method):
    """FedExP (Jhunjhunwala, Wang, Joshi, ICLR 2023, Algorithm 1): FedAvg's pseudo-gradient taken with
    an adaptive server step, x <- x + eta_g Delta, Delta = sum_k p_k Delta_k, Delta_k = theta_k - x,
    eta_g = max(1, sum_k p_k ||Delta_k||^2 / (2 (||Delta||^2 + |S| eps))) (the official code's
    ``eta_g``; the paper's text writes + eps), over the trainable parameters (BatchNorm statistics
    take the weighted mean). The metrics score the mean of the last two global models
    (``eval_average``, the official code's ``w_vec_avg``), from the second round on. The official
    schedule (``schedule=official``, main.py's ``decay``): round t's local lr is lr 0.998^(t+1) and
    its epsilon epsilon 0.998^(2(t+1)); ``local_steps`` fixes the steps per round (its cp)."""

    DECAY = 0.998  # main.py's decay
    source = Source(authors="Jhunjhunwala, Wang, Joshi",
                    title="FedExP: Speeding Up Federated Averaging via Extrapolation", venue="ICLR", year=2023,
                    arxiv="2301.09604", implements="Algorithm 1 (the server step size eta_g), the last-two average",
                    code="Divyansh03/FedExP main.py (eta_g, w_vec_avg), util_general.py (LocalUpdate)")
    name, Options = "fedexp", FedExPOptions
    # the official client: plain SGD (momentum 0), weight decay 1e-4, gradient norm clipped at 10
    run_defaults = {"momentum": 0.0, "weight_decay": 1e-4, "grad_clip": 10.0}
    INERT_EPSILON = 1e3  # 10^4 times the official code's largest (EMNIST's 0.1)

    @classmethod
    def inert(cls, options, rounds, num_clients, clients_per_round):
        if options.epsilon > cls.INERT_EPSILON:
            scale = clients_per_round if options.epsilon_scale == "clients" else 1
            return (f"epsilon = {options.epsilon:g}: eta_g = max(1, spread / 2(||Delta||^2 + eps)) exceeds 1 only when "
                    f"the clients' mean squared update norm is over 2 x {options.epsilon:g} x {scale}, so the "
                    f"extrapolation stays off and this run is FedAvg in practice (the official code's epsilon is "
                    f"1e-3 to 0.1)")

    def server_init(self, global_state, info):
        return {"eta_g": torch.ones((), dtype=torch.float64), "rounds": torch.zeros((), dtype=torch.long)}

    def aggregate(self, server_state, global_state, uploads, reports):
        o, names = self.opt, self.info.param_names
        w, models = self.client_weights(reports), [model_part(u) for u in uploads]
        mean = weighted_mean(models, w)
        spread = sum(float(p) * sum(float((m[k] - global_state[k]).double().pow(2).sum()) for k in names)
                     for p, m in zip(w, models))
        delta = {k: mean[k] - global_state[k] for k in names}
        norm = sum(float(d.double().pow(2).sum()) for d in delta.values())
        t = int(server_state["rounds"])
        eps = o.epsilon * (len(uploads) if o.epsilon_scale == "clients" else 1) * self._decay(t) ** 2
        eta = max(1.0, 0.5 * spread / (norm + eps))
        new = {**mean, **{k: global_state[k] + eta * d for k, d in delta.items()}}
        state = {"eta_g": torch.tensor(eta, dtype=torch.float64), "rounds": server_state["rounds"] + 1}
        if o.eval_average:
            state.update({"prev." + k: global_state[k] for k in names})
        return new, state

    def _decay(self, round_idx: int) -> float:
        return self.DECAY ** (round_idx + 1) if self.opt.schedule == "official" else 1.0

    def lr_scale(self, round_idx):
        return self._decay(round_idx)

    def local_steps(self, round_idx, total_steps, steps_per_epoch):
        return self.opt.local_steps or total_steps

    def evaluation_state(self, global_state, server_state):
        if not self.opt.eval_average or int(server_state.get("rounds", 0)) < 2:
            return global_state
        return {**global_state, **{k: (global_state[k] + server_state["prev." + k]) / 2 for k in self.info.param_names}}


def spreadout(weight: torch.Tensor, margin: float) -> torch.Tensor:
    """FedAwS spreadout regulariser: mean over pairs i != j of max(margin - d_ij, 0)^2 with
    d_ij = (1 - cos(w_i, w_j)) / 2 (cosine distance of classifier rows, in [0, 1])."""
    w = torch.nn.functional.normalize(weight, dim=1)
    d = (1 - w @ w.T) / 2
    c = weight.shape[0]
    off = ~torch.eye(c, dtype=torch.bool, device=weight.device)
    return torch.relu(margin - d[off]).pow(2).mean()


class FedAwSOptions(FedAvgOptions):
    search = {'margin': [0.3, 0.5, 0.7]}  # the bench's search space (fedskew bench)
    margin: float = Field(0.5, gt=0, le=1, description="cosine-distance margin between classifier rows")
    server_steps: int = Field(5, ge=0, description=
        "gradient steps of the spreadout regulariser on the classifier rows after each aggregation (0: FedAvg)")
    server_lr: float = Field(0.1, gt=0, description="learning rate of those server steps")


@builtin
class FedAwS(Method):
    """FedAwS (Yu et al., 2020): FedAvg, then ``server_steps`` gradient steps of the spreadout
    regulariser on the aggregated classifier rows (server side only). Communication as FedAvg."""

    name = "fedaws"
    Options = FedAwSOptions
    source = Source(
        authors="Yu, Rawat, Menon, Kumar",
        title="Federated Learning with Only Positive Labels",
        venue="ICML",
        year=2020,
        arxiv="2004.10342",
        implements="Algorithm 1 (the server's spreadout regulariser on the classifier)",
        code="no official code; the paper's Algorithm 1")
    requires_classifier = "linear"  # it edits the classifier rows on the server

    def aggregate(self, server_state, global_state, uploads, reports):
        new, server_state = super().aggregate(server_state, global_state, uploads, reports)
        w = new["classifier.weight"].detach().clone()
        for _ in range(self.opt.server_steps):
            w.requires_grad_(True)
            (g,) = torch.autograd.grad(spreadout(w, self.opt.margin), w)
            w = (w - self.opt.server_lr * g).detach()
        new["classifier.weight"] = w
        return new, server_state


# ---------------------------------------------------------------------------------------------
# FedDisco


class FedDiscoOptions(DiscoOptions, FedAvgOptions):
    pass


@builtin
class FedDisco(Composed):
    """FedDisco (Ye et al., ICML 2023): FedAvg aggregated with discrepancy-aware weights
    ReLU(p_k - a d_k + b) (:class:`~fedskew.algorithms.components.Discrepancy`); any method that
    aggregates with FedAvg's weights takes them as ``method.disco.disco_a=0.5`` (the paper pairs
    them with FedProx and MOON too). Sends what FedAvg does."""

    name = "feddisco"
    Options = FedDiscoOptions
    source = Source(
        authors="Ye et al.",
        title="FedDisco: Federated Learning with Discrepancy-Aware Collaboration",
        venue="ICML",
        arxiv="2305.19229", year=2023,
        implements="Eq. 3-4 (discrepancy-aware aggregation weights)",
        code="MediaBrain-SJTU/FedDisco")

    def parts(self, opt):
        return [Discrepancy(options_of(DiscoOptions, opt))]
