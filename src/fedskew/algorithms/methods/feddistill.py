"""feddistill: FedDistill / FD (Jeong et al., 2018, as PFLlib runs it): no model is shared, only each class's mean
logits; every client distils towards them. (Family ``distillation``; the class's docstring has the details.)"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import (
    ClientReport,
    FedAvgOptions,
    Method,
    Source,
    add_prefix,
    builtin,
    reference_tensor,
    strip_prefix,
)
from fedskew.algorithms.tensors import aggregate_prototypes, class_feature_means

OWN = "fd.model."  # the client's own model, kept across rounds


class FedDistillOptions(FedAvgOptions):
    search = {"lam": [0.1, 1.0, 10.0]}  # the bench's search space (fedskew bench)
    lam: float = Field(1.0, ge=0, description="weight of the distillation term (PFLlib's lamda)")
    distill: Literal["softmax_ce", "mse", "logits_ce"] = Field(
        "softmax_ce", description="the distance to the global logits T of the label: cross-entropy to softmax(T) "
                                  "(PFLlib 2024-04 to 2025-11, default), the mean squared error (PFLlib before "
                                  "2024-04), or cross-entropy with the raw logits T as targets (PFLlib at d832e76)")


def distillation_term(logits: torch.Tensor, y: torch.Tensor, global_logits: torch.Tensor, form: str,
                      mean=torch.mean) -> torch.Tensor:
    """D(z, T) with T_b the global logits of label y_b, or z_b itself (no gradient) where the
    server has none for it (NaN row): PFLlib's ``clientFD.train``. ``mean`` averages per-sample
    terms (``fwd.mean`` under padding)."""
    g = global_logits[y]
    target = torch.where(torch.isnan(g[:, :1]), logits.detach(), torch.nan_to_num(g))
    if form == "mse":  # nn.MSELoss over the B x C entries
        return mean((target - logits).pow(2).mean(1))
    soft = target.softmax(1) if form == "softmax_ce" else target
    return mean(-(soft * F.log_softmax(logits, 1)).sum(1))


def class_logits(means: list[torch.Tensor], counts: list[torch.Tensor], num_classes: int) -> torch.Tensor:
    """The server's logits of each class: the unweighted mean over the round's uploading clients
    that hold it (PFLlib's ``proto_aggregation``), NaN for a class none of them holds (rebuilt each
    round from that round's uploads only)."""
    empty = torch.full_like(means[0], float("nan"))
    return aggregate_prototypes(empty, means, [(c > 0).to(means[0].dtype) for c in counts])


@builtin
class FedDistill(Method):
    """FedDistill, or FD (Jeong, Oh, Kim, Park, Bennis and Kim, 2018, "Communication-Efficient
    On-Device Machine Learning: Federated Distillation and Augmentation under Non-IID Private
    Data"), as PFLlib's ``FD`` runs it (its label-skew leaderboard's). No model is shared: every client
    trains its own model (kept across rounds, all from the same initialisation) on CE(z, y) + lam
    D(z, T), T the global logits of the label (``distillation_term``; a label the server has no
    logits for distils towards the sample's own, which carries no gradient). After training it
    uploads the mean logits of each class it holds and the server's logits of a class are the
    unweighted mean over the round's uploading clients that hold it.

    PFLlib averages the logits its clients computed during training (before each step, all epochs);
    here they are the trained model's logits over the client's training data (eval mode), as FedProto's
    prototypes are: a method's upload is a function of its trained state. The paper's server gives each
    device the mean of the other devices' logits; PFLlib and this port include the client's own.

    No global model: ``global/*`` is none, ``personal/*`` scores each client's own model. Down: C x C
    floats; up: C x C + C."""
    family = "distillation"
    fedavg_weighted = False  # no model aggregated (Method.fedavg_weighted)

    name = "feddistill"
    Options = FedDistillOptions
    source = Source(
        authors="Jeong, Oh, Kim, Park, Bennis, Kim",
        title="Communication-Efficient On-Device Machine Learning: Federated Distillation and Augmentation under "
              "Non-IID Private Data",
        venue="NeurIPS Workshop on Machine Learning on the Phone and other Consumer Devices",
        year=2018,
        arxiv="1811.11479",
        implements="federated distillation: per-label average logits and the distillation regulariser",
        code="TsingZ0/PFLlib (system/flcore/clients/clientfd.py, servers/serverfd.py at d832e76)")
    has_global_model = False
    per_sample_loss = True  # Method.padding_exact

    def server_init(self, global_state, info):
        ref = reference_tensor(global_state)
        return {"fd.g": torch.full((info.num_classes, info.num_classes), float("nan"), dtype=ref.dtype,
                                   device=ref.device)}

    def client_init(self, client_id, global_state, info):
        return add_prefix({k: v.clone() for k, v in global_state.items()}, OWN)

    def broadcast(self, global_state, server_state):
        return {"fd.g": server_state["fd.g"]}

    def local_start(self, payload, client_state):
        return strip_prefix(client_state, OWN)

    def local_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        kd = distillation_term(logits, y, payload["fd.g"], self.opt.distill, fwd.mean)
        return fwd.cross_entropy(logits, y) + self.opt.lam * kd, {"feddistill/kd": kd.detach()}

    def after_training(self, trained, payload, client_state, report: ClientReport):
        x, y = report.local_data()
        with torch.no_grad():
            _, logits = self.info.model_call(trained, x, False)
        means, counts = class_feature_means(logits.to(payload["fd.g"].dtype), y, self.info.num_classes)
        return {"fd.mean": means, "fd.count": counts}, add_prefix(trained, OWN)

    def aggregate(self, server_state, global_state, uploads, reports):
        g = class_logits([u["fd.mean"] for u in uploads], [u["fd.count"] for u in uploads], self.info.num_classes)
        return global_state, {"fd.g": g}
