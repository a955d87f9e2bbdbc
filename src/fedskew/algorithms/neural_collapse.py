"""Neural-collapse FL: a fixed simplex-ETF classifier shared by all parties
plus global memory vectors (GMV) that pull each sample's feature toward its class's global mean.

The ETF head itself is a model option (``model.classifier=etf``, :class:`fedskew.models.nets.
ETFClassifier`), so every method that leaves the classifier alone runs with it
(``method=scaffold model.classifier=etf``). This module adds the memory vectors, ``etf_gmv``,
FedETF (Li et al., ICCV 2023), ``fedetf``, and FedGELA (Fan et al., NeurIPS 2023), ``fedgela``.

Each method of the family is a module of its own in :mod:`fedskew.algorithms.methods` (its class names the
family); this module holds the pieces several of them share.
"""

from __future__ import annotations

__all__ = []
