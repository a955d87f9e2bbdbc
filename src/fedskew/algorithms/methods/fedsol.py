"""fedsol: FedSOL (Lee, Jeong, Kim, Oh and Yun, CVPR 2024): each local step takes the cross-entropy's gradient at
w + eps, eps the proximal loss's gradient direction. (Family ``drift``; the class's docstring has the details.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin, model_part

# the norm below which the proximal gradient is round-off: at a round's first step w = w^g, the KL of two
# equal outputs is 0 and its computed gradient is rounding noise of norm ~1e-8, whose direction the
# official code scales to rho (the fixed form); here eps = 0 there, as it is in exact arithmetic
ROUND_OFF = 1e-6


class FedSOLOptions(FedAvgOptions):
    search = {"rho": [0.5, 1.0, 2.0]}  # the bench's search space (fedskew bench)
    rho: float = Field(1.0, gt=0, allow_inf_nan=False, description="the perturbation's radius rho")
    form: Literal["adaptive", "fixed"] = Field(
        "adaptive", description="eps = rho g / ||g|| scaled elementwise by |w - w^g| normalised along each tensor's "
                                "first axis (the official fedsol_adaptive, its README's) or not (fedsol_fixed)")
    temperature: float = Field(3.0, gt=0, allow_inf_nan=False,
                               description="T of the proximal loss KL(softmax(f_g / T) || softmax(f / T))")


def proximal_kl(logits: torch.Tensor, global_logits: torch.Tensor, temperature: float, mean=torch.mean) -> torch.Tensor:
    """The official proximal loss: KL(q || p) per sample, q = softmax(f(x; w^g) / T), p = softmax(f(x; w)
    / T), averaged over the batch (``nn.KLDivLoss(reduction="batchmean")``; no T^2, no weight)."""
    q = F.softmax(global_logits / temperature, 1)
    logp = F.log_softmax(logits / temperature, 1)
    return mean((torch.xlogy(q, q) - q * logp).sum(1))


def fedsol_perturbation(params: dict, grads: dict, anchor: dict, rho: float, adaptive: bool) -> dict:
    """eps of the stacked tensors [G, ...] (each client its own): rho g / (||g|| + 1e-12), ||g|| over
    all tensors; adaptive (the official ``ExpSAM.first_step``): each tensor's eps multiplied elementwise
    by |w - w^g| normalised along the tensor's first axis (``F.normalize(dim=0)``, a vector as a whole).
    A gradient of norm below ``ROUND_OFF`` gives eps = 0 (see ``FedSOL``)."""
    norm = torch.sqrt(sum(g.pow(2).flatten(1).sum(1) for g in grads.values()))
    coef = torch.where(norm < ROUND_OFF, torch.zeros_like(norm), rho / (norm + 1e-12))
    out = {}
    for k, g in grads.items():
        scale = coef.view(-1, *[1] * (g.dim() - 1))
        if adaptive:
            g = g * F.normalize((params[k] - anchor["model." + k]).abs(), p=2, dim=1)
        out[k] = g * scale
    return out


@dataclass(frozen=True)
class FedSOLSteps:
    """``Method.sam`` for FedSOL: eps from ``ascent``'s gradient (the proximal loss) by ``perturbation``."""

    rho: float
    adaptive: bool
    eta: float = 0.0
    ascent: Callable | None = field(default=None, repr=False, compare=False)

    def perturbation(self, params: dict, grads: dict, payload: dict) -> dict:
        return fedsol_perturbation(params, grads, payload, self.rho, self.adaptive)


@builtin
class FedSOL(Method):
    """FedSOL (Lee, Jeong, Kim, Oh and Yun, CVPR 2024, "FedSOL: Stabilized Orthogonal Learning with
    Proximal Restrictions in Federated Learning"). Every local step: the gradient g_p of the
    proximal loss KL(softmax(f(x; w^g) / T) || softmax(f(x; w) / T)) at w (T = 3, the received model
    w^g in eval mode), eps = rho g_p / ||g_p|| (``form=adaptive``, the official ``fedsol_adaptive``:
    each tensor's eps further scaled by |w - w^g| normalised along its first axis, so the first step
    of a round, at w = w^g, is plain SGD), then the cross-entropy's gradient at w + eps applied at w
    by the run's optimiser (its momentum and weight decay on w), through the executors'
    sharpness-aware step (``Method.sam``). Aggregation and communication as FedAvg. The official code
    updates BatchNorm statistics in the proximal pass only; here in the cross-entropy pass at w.

    At a round's first step (w = w^g) the proximal gradient is zero in exact arithmetic and rounding
    noise in floating point (norm ~1e-8); the official fixed form scales that noise to rho, a random
    direction that no second run or other executor reproduces. Here a gradient of norm below 1e-6
    (``ROUND_OFF``) gives eps = 0; the adaptive form's eps is 0 there either way."""
    family = "drift"

    name = "fedsol"
    Options = FedSOLOptions
    source = Source(
        authors="Lee, Jeong, Kim, Oh, Yun",
        title="FedSOL: Stabilized Orthogonal Learning with Proximal Restrictions in Federated Learning",
        venue="CVPR",
        year=2024,
        arxiv="2308.12532",
        implements="the proximal perturbation and the orthogonal local step (Algorithm 1)",
        code="Lee-Gihun/FedSOL (algorithms/fedsol_adaptive/ClientTrainer.py, ExpSAM, configs at ebc3f64)")
    per_sample_loss = True  # Method.padding_exact

    def __init__(self, options=None, info=None):
        super().__init__(options, info)
        self.sam = FedSOLSteps(self.opt.rho, self.opt.form == "adaptive", ascent=self.proximal_loss)

    def proximal_loss(self, fwd, params, x, y, payload, client_state):
        """The ascent loss: the official KL between the received model's and the local model's outputs."""
        _, logits = fwd(x)
        _, global_logits = fwd.frozen(model_part(payload), x)
        return proximal_kl(logits, global_logits, self.opt.temperature, fwd.mean), {}
