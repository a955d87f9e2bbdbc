"""qfedavg: q-FedAvg (Li, Sanjabi, Beirami and Smith, ICLR 2020): the q-FFL objective's server step, w <- w -
sum_k Delta_k / sum_k h_k. (Family ``server_opt``; the class's docstring has the details.)"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import (
    FedAvgOptions,
    Method,
    Source,
    as_model_part,
    builtin,
    model_part,
    reference_tensor,
)

EPS = 1e-10  # added to every F_k in the official code (and in Flower's and FedLab's)


class QFedAvgOptions(FedAvgOptions):
    search = {"q": [0.1, 1.0, 5.0]}  # the bench's search space (fedskew bench)
    q: float = Field(0.1, ge=0, allow_inf_nan=False,
                     description="fairness: the clients' losses enter as F_k^(q+1) (0: the mean of the clients' "
                                 "models; 0.1 Flower's default, the official README's Vehicle run 5)")
    lipschitz: Literal["step", "lr"] = Field(
        "step", description="L = 1 / the local step size: lr / (1 - momentum), the step SGD with momentum "
                            "settles to (step), or lr alone (lr); the same at momentum 0, the official setting")


def qffl_step(global_state: dict, models: list[dict], losses: list[float], lrs: list[float], q: float,
              names) -> dict:
    """q-FedAvg's server step (paper Algorithm 3, the official ``qffedavg.py``): with L = 1/lr,
    Delta w_k = L (w - w_k), Delta_k = F_k^q Delta w_k and h_k = q F_k^(q-1) ||Delta w_k||^2 + L F_k^q
    (F_k + 1e-10 throughout, the norm over all trainable tensors together), w <- w - sum_k Delta_k /
    sum_k h_k, computed in float64. ``names``: the trainable tensors; the others (BatchNorm
    statistics) take the clients' plain mean, as the official code's models have none."""
    num = {k: torch.zeros_like(global_state[k], dtype=torch.float64) for k in names}
    den = torch.zeros((), dtype=torch.float64)
    for model, loss, lr in zip(models, losses, lrs):
        L, f = 1.0 / lr, torch.as_tensor(float(loss), dtype=torch.float64) + EPS
        dw = {k: L * (global_state[k].double() - model[k].double()) for k in names}
        fq = f.pow(q)
        for k in names:
            num[k] += fq * dw[k]
        den = den + q * f.pow(q - 1) * sum(d.pow(2).sum() for d in dw.values()) + L * fq
    new = {k: (global_state[k].double() - num[k] / den).to(global_state[k].dtype) for k in names}
    for k, v in global_state.items():
        if k not in new:
            new[k] = torch.stack([m[k].to(torch.float64) for m in models]).mean(0).to(v.dtype)
    return new


@builtin
class QFedAvg(Method):
    """q-FedAvg (Li, Sanjabi, Beirami and Smith, ICLR 2020, "Fair Resource Allocation in Federated
    Learning", Algorithm 3), the solver of q-FFL, min_w sum_k p_k F_k(w)^(q+1) / (q+1): clients whose
    loss is higher weigh more. Each selected client first computes F_k, the mean cross-entropy of the
    received model on its whole training split (eval mode, before any local step), then trains as
    FedAvg's clients do and uploads its model and F_k. The server step (``qffl_step``) takes L as the
    inverse of the local step size, the paper's Lipschitz estimate for its plain SGD clients: the
    official code's 1/lr. With SGD momentum beta the step settles to lr / (1 - beta), so L = (1 -
    beta) / lr by default (``lipschitz=step``; the same at momentum 0): with 1/lr at momentum 0.9 the
    server moves about a tenth of FedAvg's step and stays near chance on the README setting after 20
    rounds (``lipschitz=lr`` keeps it). q = 0 gives the plain mean of the clients' models.

    The official code samples clients with probability n_k / n and averages without weights; here
    the run's client sampling (uniform) and the same unweighted step. Its ``main.py`` default q = 0
    is FedAvg; the default here, 0.1, is Flower's ``QFedAvg``'s (its README's Vehicle run uses 5).
    Communication as FedAvg, plus one float up per client."""
    family = "server_opt"
    fedavg_weighted = False  # q-FFL weighs by F_k^q, not by samples (Method.fedavg_weighted)

    name = "qfedavg"
    Options = QFedAvgOptions
    source = Source(
        authors="Li, Sanjabi, Beirami, Smith",
        title="Fair Resource Allocation in Federated Learning",
        venue="ICLR",
        year=2020,
        arxiv="1905.10497",
        implements="Algorithm 3 (q-FedAvg: Delta_k, h_k and the server step of Eq. 4's q-FFL objective)",
        code="litian96/fair_flearn (flearn/trainers/qffedavg.py at f097971; Flower's QFedAvg)")

    def client_init(self, client_id, global_state, info):
        ref = reference_tensor(global_state)
        return {"qffl.loss": torch.zeros((), dtype=torch.float32, device=ref.device)}

    def prepare(self, payload, client_state, data):
        """F_k: the received model's mean cross-entropy over the client's training split (eval mode)."""
        with torch.no_grad():
            _, logits = data.frozen(model_part(payload), data.x)
            loss = F.cross_entropy(logits.float(), data.y)
        return {**client_state, "qffl.loss": loss.to(client_state["qffl.loss"])}

    def after_training(self, trained, payload, client_state, report):
        return {**as_model_part(trained), "qffl.loss": client_state["qffl.loss"]}, client_state

    def aggregate(self, server_state, global_state, uploads, reports):
        steps = [r.lr / (1 - r.momentum) if self.opt.lipschitz == "step" else r.lr for r in reports]
        new = qffl_step(global_state, [model_part(u) for u in uploads], [float(u["qffl.loss"]) for u in uploads],
                        steps, self.opt.q, self.info.param_names)
        return new, server_state
