"""feddyn: FedDyn (Acar et al., 2021, Algorithm 1). (Family ``drift``; the class's docstring has the details.)"""

from __future__ import annotations

import torch
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, as_model_part, builtin, model_part, weighted_mean
from fedskew.algorithms.drift import _params


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
    family = "drift"

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
