"""Personalisation through an inner optimisation: pFedMe (Moreau envelopes) and Per-FedAvg
(MAML). Both take inner gradient steps inside one local step; the inner gradients are
``torch.func.grad`` calls on ``fwd.call`` (differentiable forward with other parameter values), so
they run unchanged in the sequential and the vectorised executor. The model's buffers go through
``grad`` as an argument, so BatchNorm statistics update on the inner forwards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch.func import grad_and_value

from fedskew.algorithms.base import FedAvgOptions, Method, Source, State, add_prefix, builtin, model_part, strip_prefix


def ce_grad(fwd, params: State, x: torch.Tensor, y: torch.Tensor) -> tuple[State, torch.Tensor]:
    """(d CE / d params, CE) of the model with ``params`` on (x, y), detached from the caller's graph."""
    def ce(p, buffers):
        _, logits = fwd.call({**buffers, **p}, x)
        return F.cross_entropy(logits, y)
    g, value = grad_and_value(ce)({k: v.detach() for k, v in params.items()}, fwd.buffers)
    return g, value


# ---------------------------------------------------------------------------------------------
# pFedMe


class PFedMeOptions(FedAvgOptions):
    search = {'lam': [5.0, 15.0, 30.0], 'personal_lr': [0.005, 0.01, 0.05]}  # the bench's search space (fedskew bench)
    lam: float = Field(15.0, gt=0, description="lambda of the Moreau envelope (paper: 15)")
    personal_lr: float = Field(0.01, gt=0, description="learning rate of the inner problem (paper: 0.01)")
    inner_steps: int = Field(5, ge=1, description="K, inner steps per local step (paper: 5)")
    beta: float = Field(1.0, gt=0, description="server mixing w <- (1 - beta) w + beta mean(w_k) (paper: 1 or 2)")


def moreau_solve(fwd, w: State, x, y, lam: float, lr: float, steps: int) -> tuple[State, torch.Tensor]:
    """pFedMe Eq. 7 approximately: K gradient steps on CE(theta) + (lam/2) ||theta - w||^2 from
    theta = w. Returns (theta, CE at the last iterate before its update), detached."""
    anchor = {k: v.detach() for k, v in w.items()}
    theta, value = dict(anchor), None
    for _ in range(steps):
        g, value = ce_grad(fwd, theta, x, y)
        theta = {k: theta[k] - lr * (g[k] + lam * (theta[k] - anchor[k])) for k in theta}
    return theta, value


@builtin
class PFedMe(Method):
    """pFedMe (Dinh et al., NeurIPS 2020, Algorithm 1). Each local step on a batch first solves the
    personalised problem theta = argmin CE(theta) + (lam/2) ||theta - w||^2 approximately (K steps
    at ``personal_lr`` from w; the reference warm-starts from the previous theta), then updates the
    local model with w <- w - lr * lam (w - theta): here SGD on (lam/2) ||w - theta||^2, whose
    gradient is exactly that. ``train/loss`` is the CE of the inner iterate. The server mixes
    w <- (1 - beta) w + beta * mean(w_k) (BatchNorm statistics: plain mean).

    Personalised model: after the round, K steps of the same problem from the final w on the next
    K batches of the client's stream (paper: theta of the last local step).

    Down and up: the model (FedAvg). Keeps theta and the final w (a model each) per client."""

    name = "pfedme"
    Options = PFedMeOptions
    source = Source(
        authors="T. Dinh, Tran, Nguyen",
        title="Personalized Federated Learning with Moreau Envelopes",
        venue="NeurIPS",
        year=2020,
        arxiv="2006.08848",
        implements="Algorithm 1",
        code="CharlieDinh/pFedMe")

    def client_init(self, client_id, global_state, info):
        state = {"pfedme.theta." + k: v.clone() for k, v in global_state.items()}
        state.update({"pfedme.w." + k: v.clone() for k, v in global_state.items() if k in info.param_names})
        return state

    def local_loss(self, fwd, params, x, y, payload, client_state):
        o = self.opt
        theta, ce = moreau_solve(fwd, params, x, y, o.lam, o.personal_lr, o.inner_steps)
        prox = 0.5 * o.lam * sum((p - theta[k]).pow(2).sum() for k, p in params.items())
        return ce + prox - prox.detach(), {"pfedme/prox": prox.detach()}

    def after_training(self, trained, payload, client_state, report):
        upload, _ = super().after_training(trained, payload, client_state, report)
        return upload, {**client_state, **{"pfedme.w." + k: trained[k] for k in self.info.param_names}}

    def split_steps(self, total_steps, lr):
        return total_steps, self.opt.inner_steps, self.opt.personal_lr

    def personal_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        prox = sum((p - client_state["pfedme.w." + k]).pow(2).sum() for k, p in params.items())
        return F.cross_entropy(logits, y) + 0.5 * self.opt.lam * prox, {}

    def after_personal(self, personal, payload, client_state, report):
        return {**client_state, **add_prefix(personal, "pfedme.theta.")}

    def personal_state(self, trained, client_state):
        return strip_prefix(client_state, "pfedme.theta.")

    def aggregate(self, server_state, global_state, uploads, reports):
        mean, _ = super().aggregate(server_state, global_state, uploads, reports)
        b = self.opt.beta
        return {k: (1 - b) * global_state[k] + b * mean[k] for k in global_state}, server_state


# ---------------------------------------------------------------------------------------------
# Per-FedAvg


class PerFedAvgOptions(FedAvgOptions):
    search = {'alpha': [0.001, 0.005, 0.02]}  # the bench's search space (fedskew bench)
    alpha: float = Field(
        0.005,
        gt=0,
        description="inner (adaptation) learning rate, the reference's 0.005 (0.01 collapses "
        "the global model on Fashion-MNIST P10C2); the outer one is lr",
    )
    personal_steps: int = Field(1, ge=1, description="adaptation steps of the personalised model (paper: 1)")


@builtin
class PerFedAvg(Method):
    """Per-FedAvg, first-order version (Fallah et al., NeurIPS 2020, Algorithm 1 with Eq. 8's
    first-order gradient). Each local step splits its batch into halves D and D':
    temp = w - alpha grad CE(w; D), then w <- w - lr grad CE(temp; D'). Written as the loss
    CE(temp; D') with temp = w + (a constant), whose gradient in w is exactly grad CE(temp; D');
    ``train/loss`` is that value. (The reference draws D and D' as two batches of size B; here
    they are the halves of one batch, so a round costs the same data as FedAvg's. A batch of one
    sample trains as plain SGD.)

    Personalised model: the received global model after ``personal_steps`` SGD steps at alpha on
    the client's next batches (paper: one step of adaptation). Down and up: the model (FedAvg);
    keeps the latest adapted model per client."""

    name = "perfedavg"
    Options = PerFedAvgOptions
    source = Source(
        authors="Fallah, Mokhtari, Ozdaglar",
        title="Personalized Federated Learning with Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach",
        venue="NeurIPS",
        year=2020,
        arxiv="2002.07948",
        implements="Algorithm 1 with Eq. 8's first-order gradient",
        code="no official code; the paper's Algorithm 1")

    def client_init(self, client_id, global_state, info):
        return add_prefix({k: v.clone() for k, v in global_state.items()}, "perfedavg.")

    def local_loss(self, fwd, params, x, y, payload, client_state):
        half = x.shape[0] // 2
        if half == 0:
            return super().local_loss(fwd, params, x, y, payload, client_state)
        g, _ = ce_grad(fwd, params, x[:half], y[:half])
        temp = {k: p - self.opt.alpha * g[k] for k, p in params.items()}
        _, logits = fwd.call({**fwd.buffers, **temp}, x[half:])
        return F.cross_entropy(logits, y[half:]), {}

    def split_steps(self, total_steps, lr):
        return total_steps, self.opt.personal_steps, self.opt.alpha

    def personal_start(self, trained, payload, client_state):
        return model_part(payload)

    def after_personal(self, personal, payload, client_state, report):
        return add_prefix(personal, "perfedavg.")

    def personal_state(self, trained, client_state):
        return strip_prefix(client_state, "perfedavg.")


__all__ = ["PFedMe", "PerFedAvg", "ce_grad", "moreau_solve"]
