"""fedmr: FedAvg + IntraDecorrelation(mu1) + PrototypeMargin(mu2). (Family ``fedmr``; the class's docstring has the
details.)"""

from __future__ import annotations

from fedskew.algorithms.base import FedAvgOptions, Source, builtin
from fedskew.algorithms.components import DecorrelationOptions, IntraDecorrelation, PrototypeMargin, PrototypeOptions
from fedskew.algorithms.compose import Composed, options_of


class FedMROptions(PrototypeOptions, DecorrelationOptions, FedAvgOptions):  # fields: FedAvg's first
    renamed = {"proto_share_fraction": "share_fraction"}


@builtin
class FedMR(Composed):
    """FedAvg + IntraDecorrelation(mu1) + PrototypeMargin(mu2)."""
    family = "fedmr"

    name = "fedmr"
    Options = FedMROptions
    source = Source(
        authors="Fan, Yao, Zhang, Lyu, Zhang, Wang",
        title="Federated Learning under Partially Class-Disjoint Data via Manifold Reshaping",
        venue="TMLR",
        year=2023,
        arxiv="2405.18983",
        implements="Eq. 3 (intra-class decorrelation), Eq. 4-5 (inter-class prototype margin), Eq. 6 (the local "
                   "objective)",
        code="MediaBrain-SJTU/FedMR")

    def parts(self, opt):
        return [IntraDecorrelation(options_of(DecorrelationOptions, opt)),
                PrototypeMargin(options_of(PrototypeOptions, opt))]
