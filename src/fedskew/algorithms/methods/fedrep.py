"""fedrep: FedRep (Collins et al., ICML 2021, Algorithm 1). (Family ``personalized``; the class's docstring has the
details.)"""

from __future__ import annotations

from pydantic import Field

from fedskew.algorithms.base import HEAD, FedAvgOptions, Source, body_names, builtin, fraction_steps, head_names
from fedskew.algorithms.compose import PartialSharing


class FedRepOptions(FedAvgOptions):
    search = {'head_fraction': [0.25, 0.5]}  # the bench's search space (fedskew bench)
    head_fraction: float = Field(0.5, gt=0, lt=1, description="share of the E-epoch step budget spent on the "
                                                              "head (reference code: 9 of 10 epochs)")


@builtin
class FedRep(PartialSharing):
    """FedRep (Collins et al., ICML 2021, Algorithm 1). Each round the client takes the received
    body and its own head; first trains the head with the body frozen (``head_fraction`` of the
    local steps), then the body with the head frozen (the rest). Only the body is uploaded and
    averaged; the head never leaves the client. Personalised model: the new body + own head.
    No global model: the server has no head (``global/*`` is none).

    Down and up: the body (BatchNorm statistics included). Keeps the head per client."""
    family = "personalized"

    name = "fedrep"
    Options = FedRepOptions
    source = Source(
        authors="Collins, Hassani, Mokhtari, Shakkottai",
        title="Exploiting Shared Representations for Personalized Federated Learning",
        venue="ICML",
        year=2021,
        arxiv="2102.07078",
        implements="Algorithm 1",
        code="lgcollins/FedRep")
    requires_classifier = "linear"
    has_global_model = False
    personal_first = True
    keep = "rep."

    def shared(self, key):
        return not key.startswith(HEAD)

    def split_steps(self, total_steps, lr):
        head = min(fraction_steps(total_steps, self.opt.head_fraction), max(total_steps - 1, 0))
        return total_steps - head, head, lr

    def trained_params(self, stage):
        return head_names(self.info) if stage == "personal" else body_names(self.info)

    def after_personal(self, personal, payload, client_state, report):
        return {"rep." + k: v for k, v in personal.items() if k.startswith(HEAD)}
