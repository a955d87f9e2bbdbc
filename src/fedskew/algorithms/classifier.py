"""Classifier-side methods for label skew: CCVR (server-side calibration of the head on virtual
representations), FedNH (a head of fixed-norm class prototypes, uniform at first, into which
the clients' class semantics are smoothly injected) and FedPAC (feature alignment to global
prototypes, and each client's head combined from the others' by a quadratic program); pFedFDA
(the head as a Gaussian generative classifier of interpolated local and global feature statistics).

Both read the features z the head takes (``classifier.*``, a linear layer) and leave the body to
FedAvg's averaging.

Each method of the family is a module of its own in :mod:`fedskew.algorithms.methods` (its class names the
family); this module holds the pieces several of them share.
"""

from __future__ import annotations

__all__ = []
