"""pfedme: pFedMe (Dinh et al., NeurIPS 2020, Algorithm 1). (Family ``meta``; the class's docstring has the
details.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, State, add_prefix, builtin, strip_prefix
from fedskew.algorithms.meta import ce_grad


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
    family = "meta"

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
