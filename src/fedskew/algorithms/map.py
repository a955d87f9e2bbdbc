"""The MAP family (docs/methods.md, "MAP"): restricted softmax (FedRS, Li & Zhan, KDD 2021), the
inherited private model (FedPHP, Li et al., ECML-PKDD 2021), and MAP = both (Li et al., 2023).

Both pieces are components, so they combine with any base method: ``method=scaffold
method.rs.alpha=0.5 method.hpm.kt=kd`` is the paper's ScaMAP, ``method=scaffold
method.rs.alpha=0.5`` its ScaRS.

MAP round on a selected client (default: the authors' code schedule, lxcnju/MAP
``algorithms/fedap.py``): all E local epochs train the received global model with restricted
softmax; that model is uploaded. A short second stage (max(0.1 S, 5) steps at 0.2 x lr) continues
from a copy of it with plain softmax and knowledge transfer from the client's inherited private
model (HPM); the result updates the HPM with momentum, and the HPM is the client's personalised
model. The paper's Algorithm 1 (E/2 epochs each) is ``schedule=paper``.

FedPHP (its own paper and the MAP authors' ``algorithms/fedphp.py``) is one stage: all E epochs of
(1 - lambda) CE + lambda KT from the HPM, that model is uploaded and updates the HPM
(``schedule=fedphp``, FedPHP's default).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Source, builtin
from fedskew.algorithms.components import BIAS_FREE, HPMOptions, InheritedPrivateModel, RestrictedSoftmax, RSOptions
from fedskew.algorithms.compose import Composed, options_of


class FedRSOptions(RSOptions, FedAvgOptions):
    renamed = {}


class FedPHPOptions(HPMOptions, FedAvgOptions):
    schedule: Literal["code", "paper", "fedphp"] = Field(
        "fedphp", description="fedphp: one stage with the KT term, uploaded (FedPHP, default); code/paper: MAP's "
                              "two-stage schedules without restricted softmax")


class MAPOptions(RSOptions, HPMOptions, FedAvgOptions):
    renamed = {}


@builtin
class FedRS(Composed):
    """FedAvg + restricted softmax."""

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


@builtin
class FedPHP(Composed):
    """FedPHP: all E epochs of (1 - lambda) CE + lambda KT from the HPM, uploaded; the HPM then
    takes it with momentum and is the personalised model."""

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


@builtin
class MAP(Composed):
    """FedAvg + restricted softmax on the uploaded model + the HPM personalisation stage
    (authors' code schedule by default)."""

    name = "map"
    Options = MAPOptions
    source = Source(
        authors="Li, Song, Li, Li, Shao, Yang, Zhan",
        title="MAP: Model Aggregation and Personalization in Federated Learning with Incomplete Classes",
        venue="IEEE TKDE (the text in ../shared/papers)",
        year=2024,
        implements="Eq. 8 (RS on the uploaded model) with Eq. 9-10 (HPM personalisation), Algorithm 1",
        code="lxcnju/FedRepo (the authors' code)")
    model_defaults = BIAS_FREE

    def parts(self, opt):
        return [RestrictedSoftmax(options_of(RSOptions, opt)), InheritedPrivateModel(options_of(HPMOptions, opt))]


__all__ = ["FedPHP", "FedRS", "MAP"]
