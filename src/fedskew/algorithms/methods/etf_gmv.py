"""etf_gmv: Fixed ETF head + global memory vectors. (Family ``neural_collapse``; the class's docstring has the
details.)"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedskew.algorithms.base import ClientReport, FedAvgOptions, Method, Source, builtin, reference_tensor
from fedskew.algorithms.tensors import aggregate_prototypes, class_feature_means


def aggregate_memory_vectors(previous: torch.Tensor, means: list[torch.Tensor], counts: list[torch.Tensor],
                             weighting: str = "count") -> torch.Tensor:
    """mu_c = mean over the uploading clients that hold c of their class-c mean feature, weighted
    by their class-c counts (``count``) or not (``clients``: the paper's formula); a class no
    uploading client holds keeps its previous vector (NaN: none yet)."""
    if weighting == "clients":
        counts = [(n > 0).to(n.dtype) for n in counts]
    return aggregate_prototypes(previous, means, counts)


def memory_features(z: torch.Tensor, y: torch.Tensor, vectors: torch.Tensor, alpha: float) -> torch.Tensor:
    """h = z + alpha * mu_y (a class without a vector yet adds nothing)."""
    return z + alpha * torch.nan_to_num(vectors, nan=0.0)[y]


class EtfGmvOptions(FedAvgOptions):
    search = {'gmv_alpha': [0.1, 0.5, 0.9]}  # the bench's search space (fedskew bench)
    gmv_alpha: float = Field(0.5, ge=0, description="weight of the memory vector in h = z + alpha mu_y")
    gmv_warmup_rounds: int | None = Field(None, ge=0, description="R_warm: first round trained with memory "
                                                                  "vectors (default: half of the rounds)")
    gmv_weighting: Literal["count", "clients"] = Field("count", description=
        "how the server averages the clients' class means into mu_c: count: weighted by their class-c sample "
        "counts; clients: each holding client equally (the paper's formula)")


@builtin
class EtfGmv(Method):
    """Fixed ETF head + global memory vectors.

    Rounds t < R_warm train as FedAvg with the ETF head. From round R_warm - 1 on, each selected
    client uploads the mean eval-mode feature of every class it holds and the counts (C*d + C
    floats); the server keeps the vectors mu [C, d]. From round R_warm on they are sent down (C*d
    floats) and local training classifies h = z + alpha mu_y with the ETF. Evaluation (label
    unknown) classifies z alone, as every model does. Needs ``model.classifier=etf``."""
    family = "neural_collapse"

    name = "etf_gmv"
    Options = EtfGmvOptions
    source = Source(
        authors="Huang, Xie, Yang, Wang, Lin, Cai",
        title="Neural Collapse Inspired Federated Learning with Non-iid Data",
        venue="arXiv preprint (its text names no venue)",
        year=2023,
        arxiv="2303.16066",
        implements="the fixed simplex-ETF head (Eq. 2) and the global memory vectors with warm-up (Eq. 6-8)",
        code="no official code found; the paper's text")
    requires_classifier = "etf"
    model_defaults = {"classifier": "etf"}
    per_sample_loss = True  # Method.padding_exact

    @property
    def warmup(self) -> int:
        w = self.opt.gmv_warmup_rounds
        return self.info.rounds // 2 if w is None else w

    def server_init(self, global_state, info):
        ref = reference_tensor(global_state)
        return {"gmv.mu": torch.full((info.num_classes, info.feature_dim), float("nan"), dtype=ref.dtype,
                                     device=ref.device),
                "gmv.t": torch.zeros((), dtype=ref.dtype, device=ref.device)}

    def broadcast(self, global_state, server_state):
        payload = {**super().broadcast(global_state, server_state), "gmv.t": server_state["gmv.t"]}
        if int(server_state["gmv.t"]) >= self.warmup:
            payload["gmv.mu"] = server_state["gmv.mu"]
        return payload

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, logits = fwd(x)
        if "gmv.mu" in payload:
            logits = fwd.head(memory_features(z, y, payload["gmv.mu"], self.opt.gmv_alpha))
        return fwd.cross_entropy(logits, y), {}

    def after_training(self, trained, payload, client_state, report: ClientReport):
        upload, state = super().after_training(trained, payload, client_state, report)
        if int(payload["gmv.t"]) >= self.warmup - 1:
            z, y = report.local_features(trained)
            means, counts = class_feature_means(z, y, self.info.num_classes)
            upload.update({"gmv.mean": means, "gmv.count": counts})
        return upload, state

    def aggregate(self, server_state, global_state, uploads, reports):
        new, _ = super().aggregate(server_state, global_state, uploads, reports)
        sent = [u for u in uploads if "gmv.mean" in u]
        mu = aggregate_memory_vectors(server_state["gmv.mu"], [u["gmv.mean"] for u in sent],
                                      [u["gmv.count"] for u in sent], self.opt.gmv_weighting)
        return new, {"gmv.mu": mu, "gmv.t": server_state["gmv.t"] + 1}
