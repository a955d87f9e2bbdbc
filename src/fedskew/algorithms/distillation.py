"""Knowledge distillation through the server: FedDF (ensemble distillation on public unlabelled
data), FedGen (data-free: a generator of features distilled from the clients' heads) and FedFed
(feature distillation: a federated VAE splits each input into a performance-robust part and a
performance-sensitive part, whose noised copies every client shares).

FedDF's server runs the model's architecture on states through ``FederationInfo.model_call`` and
reads the public set through ``FederationInfo.public_pool`` (drawn once from the seed; visible
to the server and, by the method's assumption, to everyone). FedGen needs no data on the server:
it trains a conditional generator of the features ``z`` the classifier reads against the
uploaded classifiers, and the clients use its samples as a regulariser.

Each method of the family is a module of its own in :mod:`fedskew.algorithms.methods` (its class names the
family); this module holds the pieces several of them share.
"""

from __future__ import annotations

__all__ = []
