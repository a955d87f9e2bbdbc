"""fedsam: FedSAM (Qu et al., ICML 2022; Caldarola et al., ECCV 2022): FedAvg whose local steps are SAM steps
(:class:`~fedskew.algorithms.components.SharpnessAware`); any other method takes them as ``method.sam.rho=0.1``.
(Family ``drift``; the class's docstring has the details.)"""

from __future__ import annotations

from fedskew.algorithms.base import Source, builtin
from fedskew.algorithms.components import SAMOptions, SharpnessAware
from fedskew.algorithms.compose import Composed, options_of
from fedskew.algorithms.drift import FedSAMOptions


@builtin
class FedSAM(Composed):
    """FedSAM (Qu et al., ICML 2022; Caldarola et al., ECCV 2022): FedAvg whose local steps are
    SAM steps (:class:`~fedskew.algorithms.components.SharpnessAware`); any other method takes
    them as ``method.sam.rho=0.1``. Two forward-backward passes per step; sends and keeps what
    FedAvg does."""
    family = "drift"

    name = "fedsam"
    Options = FedSAMOptions
    source = Source(
        authors="Caldarola, Caputo, Ciccone; Qu et al. (ICML 2022) named it too",
        title="Improving Generalization in Federated Learning by Seeking Flat Minima",
        venue="ECCV",
        year=2022,
        arxiv="2203.11834",
        implements="SAM local steps (the paper's Section 4)",
        code="debcaldarola/fedsam")

    def parts(self, opt):
        return [SharpnessAware(options_of(SAMOptions, opt))]
