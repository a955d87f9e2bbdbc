"""ditto: Ditto (Li et al., ICML 2021, Algorithm 1). (Family ``personalized``; the class's docstring has the
details.)"""

from __future__ import annotations

from fedskew.algorithms.base import Method, Source, add_prefix, builtin, fraction_steps, strip_prefix
from fedskew.algorithms.personalized import DittoOptions


@builtin
class Ditto(Method):
    """Ditto (Li et al., ICML 2021, Algorithm 1). The global update is FedAvg's local training of
    the received model w (uploaded). Then the client's personal model v, kept across rounds
    (initialised as the first received model), trains on h(v) = CE(v) + (lambda/2) ||v - w||^2
    with w the global model it received this round, for ``personal_fraction`` x the E-epoch
    step budget (reference code: as many steps as the global update). The personalised model is v.

    Sends and receives what FedAvg does; keeps v (a full model) per client."""
    family = "personalized"

    name = "ditto"
    Options = DittoOptions
    source = Source(
        authors="Li, Hu, Beirami, Smith",
        title="Ditto: Fair and Robust Federated Learning Through Personalization",
        venue="ICML",
        year=2021,
        arxiv="2012.04221",
        implements="Algorithm 1",
        code="litian96/ditto")
    per_sample_loss = True  # Method.padding_exact

    def client_init(self, client_id, global_state, info):
        return add_prefix({k: v.clone() for k, v in global_state.items()}, "ditto.")

    def split_steps(self, total_steps, lr):
        return total_steps, fraction_steps(total_steps, self.opt.personal_fraction), lr

    def personal_start(self, trained, payload, client_state):
        return strip_prefix(client_state, "ditto.")

    def personal_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        ce = fwd.cross_entropy(logits, y)
        prox = sum((p - payload["model." + k]).pow(2).sum() for k, p in params.items())
        return ce + 0.5 * self.opt.lam * prox, {"ditto/prox": prox.detach()}

    def after_personal(self, personal, payload, client_state, report):
        return add_prefix(personal, "ditto.")

    def personal_state(self, trained, client_state):
        return strip_prefix(client_state, "ditto.")
