"""fedntd: L = CE(z, y) + beta * NTD(z, frozen received global model's logits), NTD without the T^2 factor as in
the official code (Lee-Gihun/FedNTD; ``tau_squared=true`` adds it). (Family ``fedka``; the class's docstring has
the details.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin, model_part


def not_true_logits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[B, C] -> [B, C - 1]: each row without its true-class entry (order of the rest kept)."""
    C = logits.shape[-1]
    others = torch.arange(C - 1, device=logits.device)
    idx = others + (others[None, :] >= y[:, None]).long()  # skip the true class; no boolean mask (vmap)
    return logits.gather(-1, idx)


def ntd_loss(logits: torch.Tensor, global_logits: torch.Tensor, y: torch.Tensor, tau: float = 1.0,
             tau_squared: bool = False, mean=torch.mean) -> torch.Tensor:
    """KL(softmax(gz~ / T) || softmax(z~ / T)), batch mean, ~ = true class removed, times T^2 when
    ``tau_squared`` (the usual distillation scaling; the official FedNTD code has no T^2)."""
    z, g = not_true_logits(logits, y) / tau, not_true_logits(global_logits, y) / tau
    p_g = F.softmax(g, dim=-1)
    kl = (p_g * (F.log_softmax(g, dim=-1) - F.log_softmax(z, dim=-1))).sum(-1)
    return mean(kl) * (tau ** 2 if tau_squared else 1.0)


class FedNTDOptions(FedAvgOptions):
    search = {'ntd_beta': [0.1, 0.3, 1.0, 3.0], 'ntd_tau': [1.0, 3.0]}  # the bench's search space (fedskew bench)
    ntd_beta: float = Field(1.0, ge=0, description="weight of the not-true distillation term")
    ntd_tau: float = Field(1.0, gt=0, description="distillation temperature T")
    tau_squared: bool = Field(False, description="multiply the KL by T^2 (not in the official code; same at T = 1)")


@builtin
class FedNTD(Method):
    """L = CE(z, y) + beta * NTD(z, frozen received global model's logits), NTD without the T^2
    factor as in the official code (Lee-Gihun/FedNTD; ``tau_squared=true`` adds it). Communication
    as FedAvg."""
    family = "fedka"

    name = "fedntd"
    Options = FedNTDOptions
    source = Source(
        authors="Lee et al.",
        title="Preservation of the Global Knowledge by Not-True Distillation in Federated Learning",
        venue="NeurIPS",
        year=2022,
        arxiv="2106.03097",
        implements="Eq. 4-5 (not-true distillation)",
        code="Lee-Gihun/FedNTD")
    per_sample_loss = True  # Method.padding_exact

    def local_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        _, global_logits = fwd.frozen(model_part(payload), x)
        ntd = ntd_loss(logits, global_logits, y, self.opt.ntd_tau, self.opt.tau_squared, fwd.mean)
        return fwd.cross_entropy(logits, y) + self.opt.ntd_beta * ntd, {"fedntd/ntd": ntd.detach()}
