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
Default 0.01: on Fashion-MNIST P10C2 (benchmarks/baselines_fmnist.py) 0.1 stays at chance and 0.01 trains above
FedAvg. Only trainable parameters are optimised; BatchNorm statistics take the weighted mean. Communication as FedAvg;
the server keeps m (and v).

Each method of the family is a module of its own in :mod:`fedskew.algorithms.methods` (its class names the
family); this module holds the pieces several of them share.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, model_part, weighted_mean

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
