"""fedrcl: FedRCL (Seo et al., CVPR 2024): cross-entropy plus a supervised contrastive loss with hard pairs and a
penalty on same-class pairs that are too similar. (Family ``representation``; the class's docstring has the details.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin


class FedRCLOptions(FedAvgOptions):
    search = {"beta": [0.5, 1.0, 2.0]}  # the bench's search space (fedskew bench)
    temperature: float = Field(0.05, gt=0, allow_inf_nan=False, description="tau of both contrastive terms")
    threshold: float = Field(0.7, ge=-1, le=1, description="lambda: a same-class pair is penalised once even the "
                                                           "least similar one is at least this similar")
    negatives: int = Field(2, ge=1, description="hardest negatives each sample is contrasted with")
    alpha: float = Field(1.0, ge=0, description="weight of the supervised contrastive term")
    beta: float = Field(1.0, ge=0, description="weight of the divergence penalty")


def _contrast(pos: torch.Tensor, neg: torch.Tensor, temperature: float) -> torch.Tensor:
    """-log softmax([pos, neg_1, ...] / tau)[0] per sample; a non-finite value (no pair) counts 0."""
    logits = torch.cat([pos[:, None], neg], 1) / temperature
    nll = -F.log_softmax(logits, 1)[:, 0]
    return torch.where(torch.isfinite(nll), nll, torch.zeros_like(nll))


def relaxed_contrastive_terms(z: torch.Tensor, y: torch.Tensor, temperature: float, threshold: float,
                              negatives: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two per-sample terms of the official ``RCLClient`` on one feature level (``CLLoss``):
    with s the cosine similarities of the batch's features,
    SCL_i = -log e^{p_i/tau} / (e^{p_i/tau} + sum of e^{s/tau} over the ``negatives`` most similar
    other-class samples), p_i the least similar same-class sample (i itself included);
    PEN_i = softplus((c_i - s_ii) / tau) with c_i the least similar other same-class sample when it is
    at least ``threshold`` similar, else -1 (no gradient)."""
    n = F.normalize(z.flatten(1), p=2, dim=1)
    s = n @ n.T
    b = s.shape[0]
    inf = float("inf")
    same = y[None, :] == y[:, None]
    eye = torch.eye(b, dtype=torch.bool, device=s.device)
    pos = s.masked_fill(~same, inf).min(1).values
    neg = s.masked_fill(same, -inf).topk(min(negatives, b), dim=1).values
    scl = _contrast(pos, neg, temperature)
    own = s.diagonal()
    partner = s.masked_fill(~same | eye, inf).min(1).values
    partner = torch.where((partner < threshold) | torch.isinf(partner), torch.full_like(partner, -1.0), partner)
    pen = _contrast(own, partner[:, None], temperature)
    return scl, pen


@builtin
class FedRCL(Method):
    """FedRCL (Seo, Kim, Kim, Kim, Ahn, Hwang, Kim, CVPR 2024, "Relaxed Contrastive Learning for
    Federated Learning"): the local objective CE + alpha SCL + beta PEN (``relaxed_contrastive_terms``,
    the official defaults tau 0.05, lambda 0.7, two hardest negatives, weights 1). The supervised
    contrastive term pulls each sample to its least similar same-class sample against the most
    similar samples of other classes; the divergence penalty pushes a sample away from its least
    similar same-class partner once even that one is too similar (representation collapse). The
    official code averages both terms over five feature levels of its ResNet-18 (the stem and each
    stage, before their last ReLU, pooled); here they act on the one level every fedskew model has,
    the features z the classifier reads (the official option ``branch_level: [4]`` with
    ``feature_relu: True`` on its ResNet). Aggregation and communication as FedAvg."""
    family = "representation"

    name = "fedrcl"
    Options = FedRCLOptions
    source = Source(
        authors="Seo, Kim, Kim, Kim, Ahn, Hwang, Kim",
        title="Relaxed Contrastive Learning for Federated Learning",
        venue="CVPR",
        year=2024,
        arxiv="2401.04928",
        implements="the relaxed contrastive loss: supervised contrastive term and divergence penalty",
        code="skynbe/FedRCL (clients/rcl_client.py, utils/loss.py CLLoss, configs/client/RCL.yaml at 378beb4)")

    def local_loss(self, fwd, params, x, y, payload, client_state):
        o = self.opt
        z, logits = fwd(x)
        scl, pen = relaxed_contrastive_terms(z, y, o.temperature, o.threshold, o.negatives)
        scl, pen = scl.mean(), pen.mean()
        return fwd.cross_entropy(logits, y) + o.alpha * scl + o.beta * pen, {"fedrcl/scl": scl.detach(),
                                                                              "fedrcl/penalty": pen.detach()}
