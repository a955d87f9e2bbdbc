"""perfedavg: Per-FedAvg, first-order version (Fallah et al., NeurIPS 2020, Algorithm 1 with Eq. 8's first-order
gradient). (Family ``meta``; the class's docstring has the details.)"""

from __future__ import annotations

import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, add_prefix, builtin, model_part, strip_prefix
from fedskew.algorithms.meta import ce_grad


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
    family = "meta"

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
