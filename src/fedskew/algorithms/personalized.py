"""Personalised-FL baselines of the MAP paper's Table II (docs/methods.md, "Personalised heads, stages and
meta-learning"): Ditto, FedRep, FedBABU, FedROD, FedProto, and FedLC's calibrated loss; GPFL and FedCP
; FedGH, FedEM, kNN-Per and Floco.

Each method states its personalised model (scored as ``personal/acc_after``) and whether a global
model exists (``has_global_model``; FedRep and FedProto have none, so ``global/*`` is none):

=========  ======================================================  ==========================
method     personalised model                                      global model
=========  ======================================================  ==========================
ditto      personal model v, proximal to the received global one   FedAvg's
dittors    the same, the global update with restricted softmax     FedRS's
fedrep     the round's body + the client's own head                none (no shared head)
fedbabu    the received global model fine-tuned on local data      body + fixed random head
fedrod     body + generic head + personal head (logits add)        body + generic head
fedproto   the client's own model, nearest global prototype        none (no model is shared)
fedlc      the locally trained model                               FedAvg-style, calibrated
gpfl       body + conditional valve (own p_k) + the client's head   none (no shared head)
fedcp      body + CPN split between the client's and global head    none (the policy needs a head)
fedem      the M shared components mixed by the client's own pi_k  the components, mean pi
knnper     the global model interpolated with a local kNN          FedAvg's
floco      the simplex classifier at the client's projected point  the classifier at the centre
=========  ======================================================  ==========================

The head is ``classifier.*`` (the final linear layer), the body every other parameter.

Each method of the family is a module of its own in :mod:`fedskew.algorithms.methods` (its class names the
family); this module holds the pieces several of them share.
"""

from __future__ import annotations

from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions


class DittoOptions(FedAvgOptions):
    search = {'lam': [0.01, 0.1, 1.0]}  # the bench's search space (fedskew bench)
    lam: float = Field(0.1, ge=0, description="lambda of the proximal term (lambda/2) ||v - w||^2")
    personal_fraction: float = Field(1.0, gt=0, le=10, description="personal steps, as a multiple of the "
                                                                   "E-epoch step budget")


__all__ = ["DittoOptions"]
