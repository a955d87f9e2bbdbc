"""fednh: FedNH (Dai et al., AAAI 2023). (Family ``classifier``; the class's docstring has the details.)"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import (
    HEAD,
    FedAvgOptions,
    Method,
    Source,
    as_model_part,
    builtin,
    model_part,
    weighted_mean,
)
from fedskew.algorithms.tensors import class_feature_means
from fedskew.streams import torch_seed


class FedNHOptions(FedAvgOptions):
    search = {'scale': [10.0, 30.0], 'smoothing': [0.7, 0.9]}  # the bench's search space (fedskew bench)
    weighting: Literal["samples", "batches", "uniform"] = Field(
        "uniform", description="body averaging (official code: uniform over participants)")
    scale: float = Field(30.0, gt=0, description="s in logits = s cos(z, p_c) (official code's fixed scaling)")
    smoothing: float = Field(0.9, ge=0, le=1, description="rho of the prototype update p <- rho p + (1 - rho) p_new")


def cosine_logits(z: torch.Tensor, prototypes: torch.Tensor, scale: float) -> torch.Tensor:
    """s * <z/||z||, p_c/||p_c||> for every class c."""
    return scale * F.normalize(z, dim=-1) @ F.normalize(prototypes, dim=-1).T


@builtin
class FedNH(Method):
    """FedNH (Dai et al., AAAI 2023). The head's rows are class prototypes p_c, fixed during local
    training; at the start they are orthonormal random vectors (uniformity; the official code's
    ``orthogonal`` initialisation, drawn from the seed). Local loss: CE of s cos(z, p_c) (Eq. 3,
    normalised features and prototypes, fixed scale s = 30). After training each client uploads,
    per class it holds, the normalised mean of its normalised eval-mode features times its count;
    the server averages these over the clients by count, normalises, and injects them smoothly:
    p_c <- normalise(rho p_c + (1 - rho) normalise(mean_c)) (Eq. 6, rho = 0.9); a class no
    participant holds keeps its prototype. The body is averaged (uniformly over participants, as the
    official code). The global model's head holds the unit prototypes with no bias, so its argmax
    is the cosine classifier's.

    Down: the model (head = prototypes). Up: the body + C*d prototype sums + C counts."""
    family = "classifier"

    name = "fednh"
    Options = FedNHOptions
    source = Source(
        authors="Dai et al.",
        title="Tackling Data Heterogeneity in Federated Learning with Class Prototypes",
        venue="AAAI",
        year=2023,
        arxiv="2212.02758",
        implements="Eq. 5-6 (prototype initialisation and smoothed aggregation) and Algorithm 1",
        code="Yutong-Dai/FedNH")
    requires_classifier = "linear"
    model_defaults = {"classifier_bias": False}
    per_sample_loss = True  # Method.padding_exact
    model_requires = {HEAD + "bias": (False, "model.classifier_bias = false: the head is the prototypes alone")}

    def server_init(self, global_state, info):
        w = global_state[HEAD + "weight"]
        gen = torch.Generator().manual_seed(torch_seed(info.seed, "fednh"))
        protos = torch.nn.init.orthogonal_(torch.rand(w.shape, generator=gen, dtype=torch.float64), generator=gen)
        return {"fednh.p": F.normalize(protos, dim=1).to(w)}

    def broadcast(self, global_state, server_state):
        return as_model_part({**global_state, HEAD + "weight": server_state["fednh.p"]})

    def trained_params(self, stage):
        return frozenset(k for k in self.info.param_names if not k.startswith(HEAD))

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, _ = fwd(x)
        return fwd.cross_entropy(cosine_logits(z, params[HEAD + "weight"], self.opt.scale), y), {}

    def after_training(self, trained, payload, client_state, report):
        z, y = report.local_features(trained)
        means, counts = class_feature_means(F.normalize(z, dim=-1), y, self.info.num_classes)
        body = {k: v for k, v in trained.items() if not k.startswith(HEAD)}
        return {**as_model_part(body), "fednh.sum": F.normalize(means, dim=-1) * counts[:, None],
                "fednh.count": counts}, client_state

    def aggregate(self, server_state, global_state, uploads, reports):
        body = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        total = torch.stack([u["fednh.count"] for u in uploads]).sum(0)
        mean = torch.stack([u["fednh.sum"] for u in uploads]).sum(0) / total.clamp(min=1e-12)[:, None]
        rho, p = self.opt.smoothing, server_state["fednh.p"]
        new = F.normalize(rho * p + (1 - rho) * F.normalize(mean, dim=-1), dim=-1)
        new = torch.where((total > 0)[:, None], new, p)
        return {**global_state, **body, HEAD + "weight": new}, {"fednh.p": new}
