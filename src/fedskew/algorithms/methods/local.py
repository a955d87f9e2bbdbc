"""local: Local training only: each client trains its own model (initialised from the first global model) on its
own data, E epochs in each round it is selected; nothing is sent or averaged. (Family ``sharing``; the class's
docstring has the details.)"""

from __future__ import annotations

from fedskew.algorithms.base import Source, builtin
from fedskew.algorithms.compose import PartialSharing


@builtin
class Local(PartialSharing):
    """Local training only: each client trains its own model (initialised from the first global
    model) on its own data, E epochs in each round it is selected; nothing is sent or averaged.
    The lower bound a personalised method must beat (PFLlib's "Local"). Personalised model: the
    client's own model. No global model: ``global/*`` is none.

    Down and up: nothing. Keeps a whole model per client."""
    family = "sharing"

    fedavg_weighted = False  # nothing aggregated (Method.fedavg_weighted)

    name = "local"
    source = Source(
        authors="(none)",
        title="local training only: each client's own model, nothing shared; the lower bound of personalised tables "
              "(MAP Table II's 'Local')",
        venue="no paper",
        year=None,
        implements="local SGD on the client's data",
        code="no reference code: plain local SGD")
    keep = "own."
    has_global_model = False

    def shared(self, key):
        return False
