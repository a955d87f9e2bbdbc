"""fedasam: FedASAM (Caldarola et al., ECCV 2022): FedSAM with ASAM's adaptive radius (rho 0.7, eta 0.2 as the
official CIFAR-10 script). (Family ``drift``; the class's docstring has the details.)"""

from __future__ import annotations

from pydantic import Field

from fedskew.algorithms.base import Source, builtin
from fedskew.algorithms.drift import FedSAMOptions
from fedskew.algorithms.methods.fedsam import FedSAM


class FedASAMOptions(FedSAMOptions):
    rho: float = Field(0.7, gt=0, description="radius of the ascent step; FedASAM's official CIFAR-10 script: 0.7")
    adaptive: bool = Field(True, description="ASAM's scale-invariant radius T = |w| + eta (FedASAM)")
    search = {'rho': [0.3, 0.7, 1.0]}  # the bench's search space (fedskew bench)


@builtin
class FedASAM(FedSAM):
    """FedASAM (Caldarola et al., ECCV 2022): FedSAM with ASAM's adaptive radius (rho 0.7, eta 0.2
    as the official CIFAR-10 script)."""
    family = "drift"

    name = "fedasam"
    Options = FedASAMOptions
    source = Source(
        authors="Caldarola, Caputo, Ciccone",
        title="Improving Generalization in Federated Learning by Seeking Flat Minima",
        venue="ECCV",
        year=2022,
        arxiv="2203.11834",
        implements="ASAM local steps (adaptive radius, the paper's Section 4)",
        code="debcaldarola/fedsam")
