"""Personalisation through an inner optimisation: pFedMe (Moreau envelopes) and Per-FedAvg
(MAML). Both take inner gradient steps inside one local step; the inner gradients are
``torch.func.grad`` calls on ``fwd.call`` (differentiable forward with other parameter values), so
they run unchanged in the sequential and the vectorised executor. The model's buffers go through
``grad`` as an argument, so BatchNorm statistics update on the inner forwards.

Each method of the family is a module of its own in :mod:`fedskew.algorithms.methods` (its class names the
family); this module holds the pieces several of them share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import grad_and_value

from fedskew.algorithms.base import State


def ce_grad(fwd, params: State, x: torch.Tensor, y: torch.Tensor) -> tuple[State, torch.Tensor]:
    """(d CE / d params, CE) of the model with ``params`` on (x, y), detached from the caller's graph."""
    def ce(p, buffers):
        _, logits = fwd.call({**buffers, **p}, x)
        return F.cross_entropy(logits, y)
    g, value = grad_and_value(ce)({k: v.detach() for k, v in params.items()}, fwd.buffers)
    return g, value


__all__ = ["ce_grad"]
