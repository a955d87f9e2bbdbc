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

Each method of the family is a module of its own in :mod:`fedskew.algorithms.methods` (its class names the
family); this module holds the pieces several of them share.
"""

from __future__ import annotations

__all__ = []
