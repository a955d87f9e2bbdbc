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

Each method of the family is a module of its own in :mod:`fedskew.algorithms.methods` (its class names the
family); this module holds the pieces several of them share.
"""

from __future__ import annotations

__all__ = []
