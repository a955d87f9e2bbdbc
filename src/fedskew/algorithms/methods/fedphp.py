"""fedphp: FedPHP: all E epochs of (1 - lambda) CE + lambda KT from the HPM, uploaded; the HPM then takes it with
momentum and is the personalised model. (Family ``map``; the class's docstring has the details.)"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Source, builtin
from fedskew.algorithms.components import BIAS_FREE, HPMOptions, InheritedPrivateModel
from fedskew.algorithms.compose import Composed, options_of


class FedPHPOptions(HPMOptions, FedAvgOptions):
    schedule: Literal["code", "paper", "fedphp"] = Field(
        "fedphp", description="fedphp: one stage with the KT term, uploaded (FedPHP, default); code/paper: MAP's "
                              "two-stage schedules without restricted softmax")


@builtin
class FedPHP(Composed):
    """FedPHP: all E epochs of (1 - lambda) CE + lambda KT from the HPM, uploaded; the HPM then
    takes it with momentum and is the personalised model."""
    family = "map"

    name = "fedphp"
    Options = FedPHPOptions
    source = Source(
        authors="Li, Zhan, Shao, Li, Song",
        title="FedPHP: Federated Personalization with Inherited Private Models",
        venue="ECML PKDD",
        year=2021,
        implements="MAP paper Eq. 9-10 (the inherited private model and its knowledge transfer)",
        code="lxcnju/FedRepo (the MAP authors' code)")
    model_defaults = BIAS_FREE

    def parts(self, opt):
        return [InheritedPrivateModel(options_of(HPMOptions, opt))]
