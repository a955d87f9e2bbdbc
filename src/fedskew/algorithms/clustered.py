"""Clustered and multi-model federations: CFL (Sattler et al., 2021: clusters split by the cosine similarity of the
clients' updates) and FedConcat (Diao, Li and He, AAAI 2024, "Exploiting Label Skews in
Federated Learning with Model Concatenation"; the authors' code, sjtudyq/FedConcat,
``experiments.py``, ``alg == 'fedconcat'``); and FedCross (Hu et al., ICDE 2024), whose server
trains K middleware models side by side and cross-aggregates them in pairs.

The clients are clustered by their label distributions (k-means on the rows of n_k,c / n_k); in a
first phase each cluster trains its own model (encoder + linear classifier) by FedAvg among its
members; in a second phase the K encoders are frozen and concatenated, z = [z_1, ..., z_K], and
one linear classifier over z (K d -> C) is trained by all clients, a few mini-batches per round,
averaged with equal weights.

In fedskew the model is the concatenation from the start (``FedConcat.build_model``: K branches,
:class:`~fedskew.models.nets.Branches`): cluster c's model is branch c with block c of the
classifier (columns c d .. (c + 1) d) and its own bias b_c (kept by the server), so the two phases
are two uses of one architecture and need no special case in the round loop: the phase is the
server's round count (``broadcast``), the second phase's step budget ``Method.local_steps``. The
global model of the first phase is the concatenation with classifier [W_1 ... W_K] and bias
sum_c b_c, whose logits are the sum of the cluster models' logits.

Each method of the family is a module of its own in :mod:`fedskew.algorithms.methods` (its class names the
family); this module holds the pieces several of them share.
"""

from __future__ import annotations

__all__ = []
