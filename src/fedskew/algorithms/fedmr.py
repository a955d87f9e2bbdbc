"""FedMR: federated manifold reshaping (Fan, Yao, Zhang, Lyu, Zhang and Wang, "Federated Learning under
Partially Class-Disjoint Data via Manifold Reshaping", TMLR 10/2023); docs/methods.md, "FedMR".

Local objective L = CE + mu1 * L_intra + mu2 * L_inter (Eq. 6), as two components
(:mod:`fedskew.algorithms.components`):

* ``decorrelation`` (:class:`IntraDecorrelation`): intra-class decorrelation of the batch features
  (Eq. 3, in the authors' code's form by default).
* ``prototypes`` (:class:`PrototypeMargin`): the inter-class margin against global class
  prototypes (Eq. 4-5), the prototypes' computation on the client and their count-weighted
  aggregation.

``method=fedmr`` is FedAvg + both; any method takes either piece by configuration
(``method.prototypes.mu2=1e-4``, ``method.decorrelation.mu1=0.01``), as in the paper's Table 8.
"""

from __future__ import annotations

from fedskew.algorithms.base import FedAvgOptions, Source, builtin
from fedskew.algorithms.components import DecorrelationOptions, IntraDecorrelation, PrototypeMargin, PrototypeOptions
from fedskew.algorithms.compose import Composed, options_of


class FedMROptions(PrototypeOptions, DecorrelationOptions, FedAvgOptions):  # fields: FedAvg's first
    renamed = {"proto_share_fraction": "share_fraction"}


@builtin
class FedMR(Composed):
    """FedAvg + IntraDecorrelation(mu1) + PrototypeMargin(mu2)."""

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


__all__ = ["FedMR", "FedMROptions"]
