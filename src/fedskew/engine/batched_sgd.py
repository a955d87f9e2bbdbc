"""The local optimiser of many clients at once on stacked tensors (the vectorised executor's
step): clipping of each client's global gradient norm as ``clip_grad_norm_`` does it,
torch.optim.SGD's update through its fused kernel or torch.optim.Adam / AdamW's (each client its
own step count), and fp16's per-client dynamic loss scaling with GradScaler's rules."""

from __future__ import annotations

import torch

from fedskew.algorithms.base import State

FP16_INIT_SCALE, FP16_GROWTH_INTERVAL = 2.0 ** 16, 2000  # torch.amp.GradScaler's defaults


def _dense(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """(param, grad[, momentum]) in one memory layout, the parameter's (the momentum buffer has it
    by construction; a gradient that arrives in another, e.g. a loss term of the parameters beside
    the forward's transposed one, is copied into it: the fused kernel pairs elements by memory
    position, so a contiguous gradient beside a transposed weight was applied to the wrong
    entries), then viewed so that the fused SGD kernel, fast on contiguous memory only, sees
    contiguous memory: transposed views for the transposed layout of a stacked linear weight."""
    p, g, *rest = tensors
    if g.stride() != p.stride():
        g = torch.empty_like(p).copy_(g)
    if not p.is_contiguous() and p.transpose(-1, -2).is_contiguous():
        return [t.transpose(-1, -2) for t in (p, g, *rest)]
    return [p, g, *rest]


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


def optimizer_state(params: State, settings) -> State:
    """A fresh optimiser state for the stacked ``params`` (those the stage updates), flat so that a
    step's lanes are picked from it like the parameters: SGD's momentum buffers (none at momentum
    0), or Adam's first and second moments ``m.<name>``, ``v.<name>`` and each lane's step count."""
    if settings.optimizer == "sgd":
        return {n: torch.zeros_like(p) for n, p in params.items()} if settings.momentum else {}
    lanes = next(iter(params.values())).shape[0]
    return {**{f"m.{n}": torch.zeros_like(p) for n, p in params.items()},
            **{f"v.{n}": torch.zeros_like(p) for n, p in params.items()},
            "step": torch.zeros(lanes, dtype=torch.float64, device=next(iter(params.values())).device)}


@torch.no_grad()
def optimizer_step_(params: State, grads: State, state: State, lr, settings, ok: torch.Tensor | None = None) -> None:
    """One step of the settings' optimiser for every lane, in place (:func:`sgd_` or :func:`adam_`)."""
    if settings.optimizer == "sgd":
        sgd_(params, grads, state or None, lr, settings, ok)
    else:
        adam_(params, grads, state, lr, settings, ok)


def _clipped(g: list[torch.Tensor], settings) -> list[torch.Tensor]:
    """Each lane's gradients scaled to global norm <= grad_clip, as clip_grad_norm_ does."""
    if settings.grad_clip is None:
        return g
    norms = torch.sqrt(sum(t.pow(2).flatten(1).sum(1) for t in g))
    coef = torch.clamp(settings.grad_clip / (norms + 1e-6), max=1.0)
    return [t * coef.view(-1, *[1] * (t.dim() - 1)) for t in g]


def _keep_where_ok(step, tensors: list[dict], ok: torch.Tensor) -> None:
    """Run ``step()``, then give back their values to the lanes with ``ok`` False (fp16 overflow:
    GradScaler skips the optimiser step)."""
    before = [{k: v.clone() for k, v in d.items()} for d in tensors]
    step()
    for d, old in zip(tensors, before):
        for k, v in d.items():
            v.copy_(torch.where(ok.view(-1, *[1] * (v.dim() - 1)), v, old[k]))


@torch.no_grad()
def adam_(params: State, grads: State, state: State, lr, settings, ok: torch.Tensor | None = None) -> None:
    """One torch.optim.Adam step (``settings.optimizer`` adam: weight decay added to the gradient;
    adamw: decoupled, p *= 1 - lr wd first) for every lane, in place on ``params`` and ``state``
    (:func:`optimizer_state`), with torch's single-tensor arithmetic: m = lerp(m, g, 1 - b1),
    v = b2 v + (1 - b2) g^2, p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps), t each
    lane's own step count. ``lr``: a float or one per lane."""
    if ok is not None:
        _keep_where_ok(lambda: adam_(params, grads, state, lr, settings), [params, state], ok)
        return
    s = settings
    (b1, b2), names = s.betas, list(params)
    g = _clipped([grads[n] for n in names], s)
    state["step"] += 1
    t = state["step"]
    lr_t = lr.double() if isinstance(lr, torch.Tensor) else torch.full_like(t, lr)
    step_size = lr_t / (1 - b1 ** t)  # (per lane, in float64 as torch's Python floats)
    bc2_sqrt = (1 - b2 ** t).sqrt()
    for n, grad in zip(names, g):
        p, m, v = params[n], state[f"m.{n}"], state[f"v.{n}"]
        shape = (-1, *[1] * (p.dim() - 1))
        if s.weight_decay and s.optimizer == "adamw":
            p.mul_((1 - lr_t * s.weight_decay).to(p.dtype).view(shape))
        elif s.weight_decay:
            grad = grad.add(p, alpha=s.weight_decay)
        m.lerp_(grad, 1 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = (v.sqrt() / bc2_sqrt.to(p.dtype).view(shape)).add_(s.eps)
        p.sub_(m / denom * step_size.to(p.dtype).view(shape))


@torch.no_grad()
def sgd_(params: State, grads: State, momentum: State | None, lr, settings, ok: torch.Tensor | None = None) -> None:
    """One torch.optim.SGD step (dampening 0, no Nesterov) for every client at once, in place
    on ``params`` and ``momentum``; clients with ``ok`` False (fp16 overflow) keep both. ``lr``: a
    float, or a tensor of one learning rate per client (the lanes of a pack)."""
    if ok is not None:
        _keep_where_ok(lambda: sgd_(params, grads, momentum, lr, settings), [params, momentum or {}], ok)
        return
    s = settings
    names = list(params)
    g = _clipped([grads[n] for n in names], s)
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
