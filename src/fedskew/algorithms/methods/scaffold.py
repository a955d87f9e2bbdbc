"""scaffold: SCAFFOLD, option II (Karimireddy et al., 2020, Algorithm 1). (Family ``drift``; the class's docstring
has the details.)"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, as_model_part, builtin, model_part, weighted_mean
from fedskew.algorithms.drift import CORRECTION_DOC, Correction, _params, control_scale


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
    family = "drift"

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
