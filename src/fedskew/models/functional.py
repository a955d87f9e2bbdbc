"""A model as a function of its state, in one place: every ``functional_call`` of fedskew is here.

A state is a flat dict of parameters and buffers (``federated_state``'s keys); a missing entry is
taken from the module itself. The executors, the metrics and the methods' outside-training work
(``FederationInfo.model_call``) call the architecture only through these functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

State = dict[str, torch.Tensor]
HEAD = "classifier."  # the classifier's entries in a state

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def call(model: nn.Module, state: State, x: torch.Tensor, features: bool = True):
    """The architecture on ``state`` (train or eval mode as the module is): ``(z, logits)``, or the
    logits alone with ``features=False``; differentiable in ``state``."""
    if features:
        return functional_call(model, state, (x,), {"return_features": True})
    return functional_call(model, state, (x,))


def in_eval_mode(model: nn.Module, fn):
    """``fn()`` with ``model`` in eval mode (its mode restored after), with gradients as usual."""
    was_training = model.training
    model.eval()
    try:
        return fn()
    finally:
        model.train(was_training)


def eval_call(model: nn.Module, state: State, x: torch.Tensor, features: bool = True):
    """:func:`call` in eval mode (running statistics read, never updated)."""
    return in_eval_mode(model, lambda: call(model, state, x, features))


def frozen_fn(model: nn.Module) -> Callable:
    """``(state, x) -> (z, logits)`` in eval mode without gradient (``Forward.frozen``, a teacher)."""
    @torch.no_grad()
    def run(state: State, x: torch.Tensor):
        return eval_call(model, state, x)
    return run


def head_call(model: nn.Module, state: State, h: torch.Tensor) -> torch.Tensor:
    """The classifier alone on features ``h``, with the ``classifier.*`` entries of ``state``."""
    own = {k[len(HEAD):]: v for k, v in state.items() if k.startswith(HEAD)}
    return functional_call(model.classifier, own, (h,))


@torch.no_grad()
def predict(model: nn.Module, state: State, x: torch.Tensor, batch: int = 4096) -> torch.Tensor:
    """Predicted labels of the model with ``state`` (eval mode)."""
    preds = [eval_call(model, state, x[i:i + batch], features=False).argmax(1) for i in range(0, len(x), batch)]
    return torch.cat(preds) if preds else torch.empty(0, dtype=torch.long, device=x.device)


def feature_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor | None, batch: int = 4096,
               rows: torch.Tensor | None = None):
    """``state -> (z, y)`` over all of ``x`` (or its ``rows``, gathered only when called) in eval
    mode without gradient (``ClientReport.local_features``)."""
    def run(state: State):  # (no decorator: building one per client and round costs 60 us)
        xs, ys = (x, y) if rows is None else (x[rows], y[rows])
        with torch.no_grad():
            z = in_eval_mode(model, lambda: [call(model, state, xs[i:i + batch])[0] for i in range(0, len(xs), batch)])
        return torch.cat(z), ys
    return run


def model_caller(model: nn.Module) -> Callable:
    """``(state, x, train=False) -> (z, logits)``: ``model``'s architecture on ``state``, differentiable
    in it; buffers ``state`` lacks come from the model, and none is updated
    (``FederationInfo.model_call``)."""
    def run(state: State, x: torch.Tensor, train: bool = False):
        buffers = dict(model.named_buffers())  # cloned: a train-mode BatchNorm must update neither
        full = {**state, **{k: state.get(k, v).clone() for k, v in buffers.items()}}
        return call(model, full, x) if train else eval_call(model, full, x)
    return run


def bn_recalibration_fn(model: nn.Module, x: torch.Tensor, batch_size: int, rows: torch.Tensor | None = None):
    """``state -> state`` with every BatchNorm's running statistics recomputed as the plain average
    over one pass of ``x`` (or its ``rows``) in batches of ``batch_size`` (train-mode forward, no
    gradient); None when the model has no BatchNorm (``ClientReport.recalibrate_bn``)."""
    bns = {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    if not bns:
        return None

    def run(state: State) -> State:
        xs = x if rows is None else x[rows]
        new = {k: v.clone() for k, v in state.items()}
        for name in bns:
            new[f"{name}.running_mean"].zero_()
            new[f"{name}.running_var"].fill_(1.0)
        counters = {f"{name}.num_batches_tracked": torch.zeros((), dtype=torch.long, device=x.device) for name in bns}
        momenta = {name: m.momentum for name, m in bns.items()}
        was_training = model.training
        try:
            for m in bns.values():
                m.momentum = None  # cumulative moving average = plain mean over the pass
            model.train()
            with torch.no_grad():
                for i in range(0, len(xs), batch_size):
                    call(model, {**new, **counters}, xs[i:i + batch_size])
        finally:
            for name, m in bns.items():
                m.momentum = momenta[name]
            model.train(was_training)
        return new
    return run


def norm_names(model: nn.Module) -> frozenset[str]:
    """Parameter and buffer names of the model's normalisation layers (BatchNorm, GroupNorm,
    LayerNorm): kept in fp32 under mixed precision; FedBN's local tensors (``FederationInfo.norm_names``)."""
    norms = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    return frozenset(f"{name}.{k}" if name else k for name, m in model.named_modules() if isinstance(m, norms)
                     for k, _ in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)])


_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
_LOW = (torch.bfloat16, torch.float16)


def _norm_input_to_fp32(module: nn.Module, args):
    """Forward pre-hook of a normalisation layer under mixed precision: a low-precision input is
    normalised in fp32 (the layer's own dtype); the dtype it came in is kept for the output."""
    x = args[0]
    if isinstance(x, torch.Tensor) and x.dtype in _LOW:
        module._fedskew_input_dtype = x.dtype
        return (x.float(), *args[1:])
    return None


def _norm_output_back(module: nn.Module, args, out):
    """Forward hook: the output in the input's low precision (the next layer's weights are in it)."""
    dtype = module.__dict__.pop("_fedskew_input_dtype", None)
    return out.to(dtype) if dtype is not None else None


def fp32_norms(model: nn.Module) -> None:
    """Run every normalisation layer of ``model`` in fp32 when its input is bf16/fp16, the output
    cast back to the input's dtype (once per model; an fp32 input passes untouched). Under
    ``torch.func.vmap`` with per-client (stacked) BatchNorm weights, a bf16 input with fp32 weights
    and statistics fails on CPU ("expected scalar type BFloat16 but found Float") and comes out
    fp32 on CUDA (the next bf16 convolution then fails), so the vectorised executor fell back to
    sequential for every BatchNorm model in bf16 (seen on an H200). Both
    executors take this path, so they normalise alike; the statistics are fp32 either way."""
    for m in model.modules():
        if isinstance(m, _NORMS) and not getattr(m, "_fedskew_fp32_norm", False):
            m.register_forward_pre_hook(_norm_input_to_fp32)
            m.register_forward_hook(_norm_output_back)
            m._fedskew_fp32_norm = True


def low_precision(model: nn.Module, precision: str):
    """Mixed precision for ``precision=bf16|fp16`` (None for fp32): ``(cast, dtype)``, where
    ``cast(state)`` gives the copies of parameters and float buffers the training forward runs on.

    The forward runs in ``dtype`` on the input and on every tensor but the normalisation layers'
    (BatchNorm keeps fp32 weights and running statistics, normalises in fp32 and hands its output
    back in ``dtype``: :func:`fp32_norms`; it updates its statistics in place as usual); features
    and logits come back as fp32, so every loss term is computed in fp32. Master weights,
    gradients and optimizer state stay fp32. Not ``torch.autocast``: autocast does not reach inside ``torch.func.vmap``
    (``F.linear`` of batched weights stays fp32 there), so the two executors would not compute in
    the same precision."""
    if precision == "fp32":
        return None
    dtype = PRECISIONS[precision]
    keep = norm_names(model)
    fp32_norms(model)

    def cast(state: State) -> State:
        return {k: v.to(dtype) if v.is_floating_point() and k not in keep else v for k, v in state.items()}
    return cast, dtype


@dataclass(frozen=True)
class TrainingCalls:
    """The calls ``Method.local_loss`` may make on the model being trained (``Forward``'s functions):
    ``train(x)`` in train mode (buffers updated), ``frozen(state, x)``, ``head(h)``, ``call(state,
    x)`` (train mode, other parameter values, the trained buffers filling in) and ``evaluate(x)``
    (eval mode on a snapshot of the running statistics, differentiable in the parameters)."""

    train: Callable
    frozen: Callable
    head: Callable
    call: Callable
    evaluate: Callable


def training_calls(model: nn.Module, params: State, buffers: State, cast_dtype=None,
                   own: bool = False) -> TrainingCalls:
    """The :class:`TrainingCalls` of ``model`` with ``params`` and ``buffers``; ``cast_dtype``:
    :func:`low_precision`'s result for the training forward. ``own``: they are the module's own
    tensors (the sequential executor), so the fp32 training forward and the head call the module
    directly (the same computation without the reparametrisation's overhead)."""
    def state():
        return {**params, **buffers}

    if cast_dtype is not None:
        cast, dtype = cast_dtype

        def train(x):
            z, logits = call(model, cast(state()), x.to(dtype))
            return z.float(), logits.float()
    elif own:
        def train(x):
            return model(x, return_features=True)
    else:
        def train(x):
            return call(model, state(), x)

    def evaluate(x):  # a snapshot: the backward of an eval-mode pass must not see later in-place BN updates
        return eval_call(model, {**params, **{k: v.clone() for k, v in buffers.items()}}, x)

    head = model.classifier if own else (lambda h: head_call(model, state(), h))
    return TrainingCalls(train, frozen_fn(model), head, lambda s, x: call(model, {**buffers, **s}, x), evaluate)


__all__ = [
    "PRECISIONS",
    "TrainingCalls",
    "bn_recalibration_fn",
    "call",
    "eval_call",
    "feature_fn",
    "fp32_norms",
    "frozen_fn",
    "head_call",
    "in_eval_mode",
    "low_precision",
    "model_caller",
    "norm_names",
    "predict",
    "training_calls",
]
