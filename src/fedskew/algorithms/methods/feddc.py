"""feddc: FedDC (Gao et al., CVPR 2022): local drift decoupling and correction; defaults follow the official code
(gaoliang13/FedDC, ``train_FedDC``), which produced the paper's tables. (Family ``drift``; the class's docstring
has the details.)"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, as_model_part, builtin, model_part, weighted_mean
from fedskew.algorithms.drift import CORRECTION_DOC, Correction, _params, control_scale, effective_steps


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
    family = "drift"

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
