"""fedper: FedPer (Arivazhagan et al., 2019): base layers shared, personalisation layers kept. (Family ``sharing``;
the class's docstring has the details.)"""

from __future__ import annotations

from fedskew.algorithms.base import HEAD, Source, builtin
from fedskew.algorithms.compose import PartialSharing


@builtin
class FedPer(PartialSharing):  # FedRep (personalized.py) is the same sharing with alternating stages
    """FedPer (Arivazhagan et al., 2019): base layers shared, personalisation layers kept. Each
    round the client trains body and its own head together (E epochs, one stage; unlike FedRep's
    alternating head-then-body epochs); only the body is averaged. Personalised model: the new
    body with the client's head. The server has no head: ``global/*`` is none.

    Down and up: the body (BatchNorm statistics included). Keeps the head per client."""
    family = "sharing"

    name = "fedper"
    source = Source(
        authors="Arivazhagan et al.",
        title="Federated Learning with Personalization Layers",
        venue="arXiv preprint",
        year=2019,
        arxiv="1912.00818",
        implements="Algorithm 1 (base layers shared, personalisation layers kept)",
        code="no official code; the paper's Algorithm 1")
    keep = "per."
    requires_classifier = "linear"
    has_global_model = False

    def shared(self, key):
        return not key.startswith(HEAD)
