"""SGD of many clients at once on stacked tensors (the vectorised executor's step): clipping of
each client's global gradient norm as ``clip_grad_norm_`` does it, torch.optim.SGD's update
through its fused kernel, and fp16's per-client dynamic loss scaling with GradScaler's rules."""

from __future__ import annotations

import torch

from fedskew.algorithms.base import State

FP16_INIT_SCALE, FP16_GROWTH_INTERVAL = 2.0 ** 16, 2000  # torch.amp.GradScaler's defaults


def _dense(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """(param, grad[, momentum]) viewed so that the fused SGD kernel, fast on contiguous memory
    only, sees contiguous memory: transposed views when all three share the transposed layout of
    a stacked linear weight; else the gradient in the parameter's layout."""
    p = tensors[0]
    if not p.is_contiguous() and p.transpose(-1, -2).is_contiguous() and all(t.stride() == p.stride() for t in tensors):
        return [t.transpose(-1, -2) for t in tensors]
    return [p, tensors[1] if tensors[1].stride() == p.stride() else tensors[1].contiguous(), *tensors[2:]]


@torch.no_grad()
def unscale(grads, scaler: dict[str, torch.Tensor]):
    """torch.amp.GradScaler's unscale and update, per client: the gradients divided by each
    client's scale, which clients' are all finite (the others skip the step), and ``scaler``
    updated in place (x0.5 after a skip; x2 after ``FP16_GROWTH_INTERVAL`` good steps)."""
    scale, good = scaler["scale"], scaler["good"]
    inv = scale.double().reciprocal().float()
    grads = [g * inv.view(-1, *[1] * (g.dim() - 1)) for g in grads]
    ok = torch.stack([g.flatten(1).isfinite().all(1) for g in grads]).all(0)
    good = torch.where(ok, good + 1, torch.zeros_like(good))
    grow = good == FP16_GROWTH_INTERVAL
    scaler["scale"] = torch.where(ok, torch.where(grow, scale * 2.0, scale), scale * 0.5)
    scaler["good"] = torch.where(grow, torch.zeros_like(good), good)
    return grads, ok


@torch.no_grad()
def sgd_(params: State, grads: State, momentum: State | None, lr, settings, ok: torch.Tensor | None = None) -> None:
    """One torch.optim.SGD step (dampening 0, no Nesterov) for every client at once, in place
    on ``params`` and ``momentum``; clients with ``ok`` False (fp16 overflow) keep both. ``lr``: a
    float, or a tensor of one learning rate per client (the lanes of a pack)."""
    if ok is not None:
        before = [dict(params), dict(momentum or {})]
        before = [{k: v.clone() for k, v in d.items()} for d in before]
        sgd_(params, grads, momentum, lr, settings)
        for d, old in zip((params, momentum or {}), before):
            for k, v in d.items():
                v.copy_(torch.where(ok.view(-1, *[1] * (v.dim() - 1)), v, old[k]))
        return
    s = settings
    names = list(params)
    g = [grads[n] for n in names]
    if s.grad_clip is not None:
        norms = torch.sqrt(sum(t.pow(2).flatten(1).sum(1) for t in g))
        coef = torch.clamp(s.grad_clip / (norms + 1e-6), max=1.0)
        g = [t * coef.view(-1, *[1] * (t.dim() - 1)) for t in g]
    # torch.optim.SGD's fused kernel: g += wd * p; buf = m * buf + g; p -= lr * buf (one pass
    # over the tensors instead of four; the zero-initialised buffer makes the first step buf = g).
    p = [params[n] for n in names]
    m = [momentum[n] for n in names] if momentum is not None else []
    for i, group in enumerate(zip(p, g, m) if m else zip(p, g)):
        p[i], g[i], *rest = _dense(list(group))
        if m:
            m[i] = rest[0]
    if isinstance(lr, torch.Tensor):
        plain_sgd_(p, g, m, s.weight_decay, s.momentum if m else 0.0, lr)
    else:
        fused_sgd_(p, g, m, s.weight_decay, s.momentum if m else 0.0, lr)


def fused_sgd_(p: list[torch.Tensor], g: list[torch.Tensor], m: list[torch.Tensor], weight_decay: float,
               momentum: float, lr: float) -> None:
    """torch.optim.SGD's update on lists of tensors, in place: ``g += wd p``, ``buf = m buf + g``,
    ``p -= lr buf`` (``m`` empty: no momentum). Through the fused kernel ``torch._fused_sgd_``
    (private API, in torch >= 2.1 on CPU and CUDA) where it exists and takes these tensors; else
    the same arithmetic as separate in-place steps (:func:`plain_sgd_`, equal to the kernel's to
    float rounding)."""
    kernel = getattr(torch, "_fused_sgd_", None)
    if kernel is not None:
        try:
            kernel(p, g, m, weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=0.0, nesterov=False,
                   maximize=False, is_first_step=False)
            return
        except (RuntimeError, NotImplementedError, TypeError):  # a device or dtype the kernel does not take
            pass
    plain_sgd_(p, g, m, weight_decay, momentum, lr)


def plain_sgd_(p: list[torch.Tensor], g: list[torch.Tensor], m: list[torch.Tensor], weight_decay: float,
               momentum: float, lr) -> None:
    """:func:`fused_sgd_` without the private kernel; ``lr`` a float or one per client (a tensor
    along the leading dimension)."""
    for i, (param, grad) in enumerate(zip(p, g)):
        d = grad.add(param, alpha=weight_decay) if weight_decay else grad
        if m:
            m[i].mul_(momentum).add_(d)
            d = m[i]
        if isinstance(lr, torch.Tensor):
            param.sub_(d * lr.view(-1, *[1] * (param.dim() - 1)))
        else:
            param.add_(d, alpha=-lr)
