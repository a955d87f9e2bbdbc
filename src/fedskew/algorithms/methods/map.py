"""map: FedAvg + restricted softmax on the uploaded model + the HPM personalisation stage (authors' code schedule
by default). (Family ``map``; the class's docstring has the details.)"""

from __future__ import annotations

from fedskew.algorithms.base import FedAvgOptions, Source, builtin
from fedskew.algorithms.components import BIAS_FREE, HPMOptions, InheritedPrivateModel, RestrictedSoftmax, RSOptions
from fedskew.algorithms.compose import Composed, options_of


class MAPOptions(RSOptions, HPMOptions, FedAvgOptions):
    renamed = {}


@builtin
class MAP(Composed):
    """FedAvg + restricted softmax on the uploaded model + the HPM personalisation stage
    (authors' code schedule by default)."""
    family = "map"

    name = "map"
    Options = MAPOptions
    source = Source(
        authors="Li, Song, Li, Li, Shao, Yang, Zhan",
        title="MAP: Model Aggregation and Personalization in Federated Learning with Incomplete Classes",
        venue="IEEE TKDE",
        year=2024,
        implements="Eq. 8 (RS on the uploaded model) with Eq. 9-10 (HPM personalisation), Algorithm 1",
        code="lxcnju/FedRepo (the authors' code)")
    model_defaults = BIAS_FREE

    def parts(self, opt):
        return [RestrictedSoftmax(options_of(RSOptions, opt)), InheritedPrivateModel(options_of(HPMOptions, opt))]
