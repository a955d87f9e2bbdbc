"""fedbn: FedBN (Li et al., ICLR 2021, Algorithm 1): FedAvg in which every client keeps its own normalisation
layers (BatchNorm weight, bias and running statistics; also GroupNorm and LayerNorm,
``FederationInfo.norm_names``); they are neither sent up nor overwritten by the received model. (Family
``sharing``; the class's docstring has the details.)"""

from __future__ import annotations

from fedskew.algorithms.base import Source, builtin
from fedskew.algorithms.compose import PartialSharing


@builtin
class FedBN(PartialSharing):
    """FedBN (Li et al., ICLR 2021, Algorithm 1): FedAvg in which every client keeps its own
    normalisation layers (BatchNorm weight, bias and running statistics; also GroupNorm and
    LayerNorm, ``FederationInfo.norm_names``); they are neither sent up nor overwritten by the
    received model. The paper evaluates each client with its own BN layers: the personalised
    model. The server never sees BN statistics, so a model with normalisation layers has no
    global model to score (``global/*`` none); without any (the MLP) FedBN is exactly FedAvg.

    Down and up: the model without its normalisation tensors. Keeps those per client."""
    family = "sharing"

    name = "fedbn"
    source = Source(
        authors="Li et al.",
        title="FedBN: Federated Learning on Non-IID Features via Local Batch Normalization",
        venue="ICLR",
        year=2021,
        arxiv="2102.07623",
        implements="Algorithm 1",
        code="med-air/FedBN")
    keep = "bn."

    def __init__(self, options=None, info=None):
        super().__init__(options, info)
        self.has_global_model = not (info is not None and info.norm_names)

    def shared(self, key):
        return key not in self.info.norm_names
