"""Partial model sharing and model mixing: FedBN, FedPer, LG-FedAvg, APFL, FedALA, FedFOMO, FedAMP,
FLDA, FedDBE, FedAS, FedCAC and FedAH.

Methods of this family differ from FedAvg in *which* tensors of the model a client shares and how
it combines what it receives with what it keeps:

=========  =====================================  =====================================  ==============
method     kept on the client                     sent up and averaged                   global model
=========  =====================================  =====================================  ==============
fedbn      normalisation layers (BN params+stats)  every other tensor                     FedAvg's if the
                                                                                         model has no BN
fedper     the head (``classifier.*``)            the body                               none
lgfedavg   the body (all but the last layers)     the last ``global_layers`` layers      none
apfl       a personal model v and the mixture     the global model w (FedAvg's)          FedAvg's
fedala     the local model                        the locally trained model (FedAvg's)   FedAvg's
fedfomo    its own model                          its model + weights (server keeps all) none
fedamp     its own model                          its model (server keeps all, mixes)    none
flda       a private model and the gate           the model (FedAvg's)                   FedAvg's
feddbe     its representation bias mu_k (d)       the model without mu_k (FedAvg's)      FedAvg's
fedas      its head (the body: the aligned global) the model + its Fisher trace            Fisher-weighted
fedcac     its critical-parameter mask            the model + the mask (server keeps a   FedAvg's
                                                  customised model per client)
fedah      its head and the head's mixing weights  the model                              FedAvg's
=========  =====================================  =====================================  ==============

A method without a global model reports ``global/*`` as none (``has_global_model``); FedBN has one
only when the model has no normalisation layer (its BN layers never leave the clients).

Each method of the family is a module of its own in :mod:`fedskew.algorithms.methods` (its class names the
family); this module holds the pieces several of them share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedskew.algorithms.base import State


def ala_epoch(model_call, start: State, local: State, diff: State, weights: State, batches, eta: float
              ) -> tuple[State, float]:
    """One pass of adaptive local aggregation (FedALA, Zhang et al., AAAI 2023, Eq. 4-6) over
    ``batches`` of (x, y): per batch, the mixed tensors theta_hat = theta + (theta_g - theta) * W
    (``diff`` = theta_g - theta for the tensors in ``weights``; ``start`` gives the others) score
    the training-mode cross-entropy, and W <- clip(W - eta * grad_theta_hat L * (theta_g - theta),
    0, 1). Returns the new W and the last batch's loss (FedALA and FedAH)."""
    loss = torch.zeros(())
    for x, y in batches:
        mixed = {k: (local[k] + diff[k] * w).requires_grad_(True) for k, w in weights.items()}
        _, logits = model_call({**start, **mixed}, x, True)
        loss = F.cross_entropy(logits, y)
        grads = torch.autograd.grad(loss, list(mixed.values()))
        weights = {k: torch.clamp(w - eta * g * diff[k], 0, 1) for (k, w), g in zip(weights.items(), grads)}
    return weights, float(loss.detach())


__all__ = ["ala_epoch"]
