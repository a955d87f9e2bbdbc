"""feddecorr: FedDecorr (Shi et al., ICLR 2023): FedAvg + beta * the decorrelation regulariser; any other method
takes it as ``method.feddecorr.beta=0.1``. (Family ``representation``; the class's docstring has the details.)"""

from __future__ import annotations

import dataclasses

from fedskew.algorithms.base import FedAvgOptions, builtin
from fedskew.algorithms.components import Decorrelation, FedDecorrOptions
from fedskew.algorithms.compose import Composed, options_of


class FedDecorrMethodOptions(FedDecorrOptions, FedAvgOptions):
    pass


@builtin
class FedDecorr(Composed):
    """FedDecorr (Shi et al., ICLR 2023): FedAvg + beta * the decorrelation regulariser; any other
    method takes it as ``method.feddecorr.beta=0.1``. Sends and keeps what FedAvg does."""
    family = "representation"

    name = "feddecorr"
    Options = FedDecorrMethodOptions
    source = dataclasses.replace(Decorrelation.source, implements="Eq. 4 (the decorrelation regulariser)")

    def parts(self, opt):
        return [Decorrelation(options_of(FedDecorrOptions, opt))]
