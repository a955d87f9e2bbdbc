"""apfl: APFL (Deng et al., 2020, Algorithm 1). (Family ``sharing``; the class's docstring has the details.)"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from fedskew.algorithms.base import (
    ClientData,
    FedAvgOptions,
    Method,
    Source,
    State,
    add_prefix,
    as_model_part,
    builtin,
    reference_tensor,
    strip_prefix,
)


class APFLOptions(FedAvgOptions):
    search = {'alpha': [0.25, 0.5, 0.75]}  # the bench's search space (fedskew bench)
    alpha: float = Field(0.5, ge=0, le=1, description="mixing weight of the personal model: v_bar = alpha v + "
                                                      "(1 - alpha) w (FL-bench's initial value); with "
                                                      "alpha_mode=adaptive, every client's starting value")
    alpha_mode: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed: alpha never changes (default); adaptive: the paper's update alpha <- alpha - "
                             "alpha_lr <v - w, grad f(v_bar)>, once per visit, clipped to [0, 1]")
    alpha_lr: float = Field(0.01, gt=0, description="adaptive: the learning rate of alpha")

    @model_validator(mode="after")
    def _positive_fixed_alpha(self):
        if self.alpha_mode == "fixed" and self.alpha == 0:
            raise ValueError("alpha = 0 with alpha_mode=fixed never trains the personal model; use alpha > 0")
        return self


def apfl_alpha_step(alpha: torch.Tensor, v: State, w: State, grad: State, lr: float) -> torch.Tensor:
    """APFL's alpha update (Deng et al., 2020, Algorithm 1, line 8): grad_alpha f(v_bar) =
    <v - w, grad f(v_bar)> over the trainable tensors, alpha <- clip(alpha - lr grad_alpha, 0, 1)."""
    g = sum((v[k] - w[k]).flatten() @ grad[k].flatten() for k in grad)
    return torch.clamp(alpha - lr * g, 0.0, 1.0)


@builtin
class APFL(Method):
    """APFL (Deng et al., 2020, Algorithm 1). Each client keeps a personal model v; its
    personalised model is the mixture v_bar = alpha v + (1 - alpha) w of v and the local version
    w of the global model. The global model trains as in FedAvg (uploaded, averaged); v trains on
    the loss of the mixture, grad_v f(v_bar) = alpha grad f(v_bar), for as many steps as the
    global update, after it, with w the round's locally trained global model (Algorithm 1
    interleaves the two updates step by step).

    ``alpha_mode=fixed`` (default): SGD on v (learning rate eta) runs as SGD on v_bar itself with w
    held fixed and learning rate eta alpha^2 (v_bar <- v_bar - eta alpha^2 grad f(v_bar) is exactly
    v <- v - eta alpha grad f(v_bar); with momentum too; weight decay, if set, applies to v_bar).
    ``alpha_mode=adaptive``: alpha is each client's own (kept in its state) and the stage trains v
    itself on f(alpha v + (1 - alpha) w); at the start of each visit after the first, alpha takes
    one step of Algorithm 1's update on the full local gradient at the last visit's v_bar
    (:func:`apfl_alpha_step`; Algorithm 1 takes one per local step).

    Down and up: what FedAvg sends. Keeps v and the round's local w per client (2 models; +1
    float, alpha, when adaptive)."""
    family = "sharing"

    name = "apfl"
    Options = APFLOptions
    source = Source(
        authors="Deng, Kamani, Mahdavi",
        title="Adaptive Personalized Federated Learning",
        venue="arXiv preprint",
        year=2020,
        arxiv="2003.13461",
        implements="Algorithm 1 (the mixture of personal and global models with adaptive alpha)",
        code="MLOPTPSU/FedTorch")
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss in both stages)

    def client_init(self, client_id, global_state, info):
        state = {**add_prefix({k: v.clone() for k, v in global_state.items()}, "apfl.v."),
                 **add_prefix({k: v.clone() for k, v in global_state.items()}, "apfl.w.")}
        if self.opt.alpha_mode == "adaptive":
            state["apfl.alpha"] = torch.tensor(self.opt.alpha, dtype=reference_tensor(global_state).dtype,
                                               device=reference_tensor(global_state).device)
        return state

    def prepare(self, payload, client_state, data: ClientData):
        if self.opt.alpha_mode != "adaptive":
            return client_state
        v, w = strip_prefix(client_state, "apfl.v."), strip_prefix(client_state, "apfl.w.")
        mixed = self._mix(v, w, client_state)
        params = {k: mixed[k].detach().requires_grad_(True) for k in self.info.param_names}
        _, logits = self.info.model_call({**mixed, **params}, data.x)
        grad = dict(zip(params, torch.autograd.grad(F.cross_entropy(logits, data.y), list(params.values()))))
        return {**client_state, "apfl.alpha": apfl_alpha_step(client_state["apfl.alpha"], v, w, grad,
                                                             self.opt.alpha_lr).detach()}

    def after_training(self, trained, payload, client_state, report):
        return as_model_part(trained), {**client_state, **add_prefix(trained, "apfl.w.")}

    def split_steps(self, total_steps, lr):
        return total_steps, total_steps, lr * self.opt.alpha ** 2 if self.opt.alpha_mode == "fixed" else lr

    def _alpha(self, client_state):
        return client_state["apfl.alpha"] if self.opt.alpha_mode == "adaptive" else self.opt.alpha

    def _mix(self, v, w, client_state):
        a = self._alpha(client_state)
        return {k: a * v[k] + (1 - a) * w[k] if v[k].is_floating_point() else w[k] for k in w}

    def personal_start(self, trained, payload, client_state):
        v = strip_prefix(client_state, "apfl.v.")
        return v if self.opt.alpha_mode == "adaptive" else self._mix(v, trained, client_state)

    def personal_loss(self, fwd, params, x, y, payload, client_state):
        if self.opt.alpha_mode == "fixed":
            return super().personal_loss(fwd, params, x, y, payload, client_state)
        a, w = client_state["apfl.alpha"], strip_prefix(client_state, "apfl.w.")
        _, logits = fwd.call({k: a * p + (1 - a) * w[k] for k, p in params.items()}, x)
        return fwd.cross_entropy(logits, y), {"apfl/alpha": a.detach()}

    def after_personal(self, personal, payload, client_state, report):
        if self.opt.alpha_mode == "adaptive":
            return {**client_state, **add_prefix(personal, "apfl.v.")}
        a, w = self.opt.alpha, strip_prefix(client_state, "apfl.w.")
        v = {k: (personal[k] - (1 - a) * w[k]) / a if w[k].is_floating_point() else personal[k] for k in w}
        return {**client_state, **add_prefix(v, "apfl.v.")}

    def personal_state(self, trained, client_state):
        return self._mix(strip_prefix(client_state, "apfl.v."), trained, client_state)
