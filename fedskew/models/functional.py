"""A model as a function of its state: ``functional_call`` views of an ``nn.Module`` (state =
parameters + buffers as a flat dict), shared by the executors and the metrics.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

State = dict[str, torch.Tensor]


@torch.no_grad()
def predict(model: nn.Module, state: State, x: torch.Tensor, batch: int = 4096) -> torch.Tensor:
    """Predicted labels of the model with ``state`` (eval mode)."""
    was_training = model.training
    model.eval()
    try:
        preds = [functional_call(model, state, (x[i:i + batch],)).argmax(1) for i in range(0, len(x), batch)]
    finally:
        model.train(was_training)
    return torch.cat(preds) if preds else torch.empty(0, dtype=torch.long, device=x.device)


def in_eval_mode(model: nn.Module, fn):
    """``fn()`` with ``model`` in eval mode (its mode restored after), with gradients as usual."""
    was_training = model.training
    model.eval()
    try:
        return fn()
    finally:
        model.train(was_training)


def feature_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor | None, batch: int = 4096,
               rows: torch.Tensor | None = None):
    """``state -> (z, y)`` over all of ``x`` (or its ``rows``, gathered only when called) in eval
    mode without gradient (``ClientReport.local_features``)."""
    def run(state: State):  # (no decorator: building one per client and round costs 60 us)
        xs, ys = (x, y) if rows is None else (x[rows], y[rows])
        with torch.no_grad():
            z = in_eval_mode(model, lambda: [functional_call(model, state, (xs[i:i + batch],), {"return_features": True})[0]
                                             for i in range(0, len(xs), batch)])
        return torch.cat(z), ys
    return run


__all__ = ["feature_fn", "in_eval_mode", "predict"]
