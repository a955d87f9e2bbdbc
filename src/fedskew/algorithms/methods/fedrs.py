"""fedrs: FedAvg + restricted softmax. (Family ``map``; the class's docstring has the details.)"""

from __future__ import annotations

from fedskew.algorithms.base import FedAvgOptions, Source, builtin
from fedskew.algorithms.components import BIAS_FREE, RestrictedSoftmax, RSOptions
from fedskew.algorithms.compose import Composed, options_of


class FedRSOptions(RSOptions, FedAvgOptions):
    renamed = {}


@builtin
class FedRS(Composed):
    """FedAvg + restricted softmax."""
    family = "map"

    name = "fedrs"
    Options = FedRSOptions
    source = Source(
        authors="Li, Zhan",
        title="FedRS: Federated Learning with Restricted Softmax for Label Distribution Non-IID Data",
        venue="KDD",
        year=2021,
        implements="MAP paper Eq. 8 (restricted softmax)",
        code="lxcnju/FedRepo (the MAP authors' code)")
    model_defaults = BIAS_FREE

    def parts(self, opt):
        return [RestrictedSoftmax(options_of(RSOptions, opt))]
