"""dittors: DittoRS (MAP paper, Table II): Ditto whose global update trains with restricted softmax. (Family
``personalized``; the class's docstring has the details.)"""

from __future__ import annotations

from fedskew.algorithms.base import Source, builtin
from fedskew.algorithms.components import BIAS_FREE, RestrictedSoftmax, RSOptions
from fedskew.algorithms.compose import Composed, options_of
from fedskew.algorithms.methods.ditto import Ditto
from fedskew.algorithms.personalized import DittoOptions


class DittoRSOptions(RSOptions, DittoOptions):
    renamed = {}


@builtin
class DittoRS(Composed):
    """DittoRS (MAP paper, Table II): Ditto whose global update trains with restricted softmax."""
    family = "personalized"

    name = "dittors"
    Options = DittoRSOptions
    source = Source(
        authors="Li, Song, Li, Li, Shao, Yang, Zhan",
        title="MAP: Model Aggregation and Personalization in Federated Learning with Incomplete Classes (DittoRS, a "
              "Table II baseline)",
        venue="IEEE TKDE",
        year=2024,
        implements="Ditto's Algorithm 1 with MAP Eq. 8 (restricted softmax) on the global update",
        code="lxcnju/FedRepo")
    base_method = Ditto
    model_defaults = BIAS_FREE

    def parts(self, opt):
        return [RestrictedSoftmax(options_of(RSOptions, opt))]
