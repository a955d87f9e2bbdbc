"""FedNTD (Lee et al., NeurIPS 2022), FedLMD (Lu et al., ACM MM 2023), FedVLS (Guo et al., AAAI 2025)
and FedKA (knowledge anchor, 2023) (docs/methods.md, "Keeping what the global model knows").

Both keep the received global model's knowledge of the classes a client lacks: FedNTD distils the
global model's *not-true* class distribution on every batch; FedKA distils the global model's
logits of missing and non-dominant classes on a small anchor set (one sample per such class).

Each method of the family is a module of its own in :mod:`fedskew.algorithms.methods` (its class names the
family); this module holds the pieces several of them share.
"""

from __future__ import annotations

__all__ = []
