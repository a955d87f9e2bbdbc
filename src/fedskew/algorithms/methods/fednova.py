"""fednova: FedNova (Wang et al., 2020): normalised averaging. (Family ``drift``; the class's docstring has the
details.)"""

from __future__ import annotations

import torch

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin, model_part, weighted_mean
from fedskew.algorithms.drift import effective_steps


@builtin
class FedNova(Method):
    """FedNova (Wang et al., 2020): normalised averaging.

    a_i = [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho) for local SGD momentum rho
    (a_i = tau_i when rho = 0); d_i = (x - y_i) / a_i; p_i = n_i / sum n;
    x <- x - (sum_i p_i a_i) sum_i p_i d_i. BatchNorm statistics: sample-weighted mean.
    Sends and keeps what FedAvg does.
    """
    family = "drift"

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
