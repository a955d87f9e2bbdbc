"""fedproto: FedProto (Tan et al., AAAI 2022). (Family ``personalized``; the class's docstring has the details.)"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedskew.algorithms.base import (
    HEAD,
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


class FedProtoOptions(FedAvgOptions):
    search = {'lam': [0.1, 1.0, 10.0]}  # the bench's search space (fedskew bench)
    lam: float = Field(1.0, ge=0, description="weight of the prototype regulariser")
    proto_weighting: Literal["clients", "count"] = Field(
        "clients", description="server prototype = unweighted mean over the clients holding the class (official "
                               "code, default) or weighted by their counts (paper Eq. 8)")


def prototype_regularizer(z: torch.Tensor, y: torch.Tensor, prototypes: torch.Tensor, mean=torch.mean) -> torch.Tensor:
    """FedProto's R = mean squared distance between each feature z and the global prototype of
    its class (reference code: MSE over samples and dimensions); samples of a class without a
    global prototype (NaN row) contribute 0, as in the reference, which keeps them in the mean."""
    target = prototypes[y]
    known = ~torch.isnan(target[:, :1])
    diff = torch.where(known, z - torch.nan_to_num(target), torch.zeros_like(z))
    return mean(diff.pow(2))


def nearest_prototype_head(prototypes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear head (W, b) whose argmax is the nearest prototype: logit_c = 2 g_c.z - ||g_c||^2
    = ||z||^2 - ||z - g_c||^2. Classes without a prototype (NaN) get a -1e30 bias."""
    known = ~torch.isnan(prototypes[:, 0])
    g = torch.nan_to_num(prototypes)
    bias = torch.where(known, -g.pow(2).sum(1), torch.full_like(g[:, 0], -1e30))
    return 2 * g, bias


@builtin
class FedProto(Method):
    """FedProto (Tan et al., AAAI 2022). No model is shared: every client trains its own model
    (kept across rounds, all starting from the same initialisation) on CE + lam * R(z, g_y), R the
    squared distance to the global prototype of the label (Eq. 7). After training it uploads the
    mean eval-mode feature of each class it holds and the counts; the server's prototype of a class
    is the unweighted mean over the uploading clients that hold it, as in the official code
    (``proto_weighting=count``: count-weighted, paper Eq. 8), kept when none holds it. The official
    code averages training-mode features of the last local epoch; here the features are computed
    after training in eval mode (the same for models without BatchNorm or dropout).

    Prediction by nearest prototype (paper Section 4): the personalised model is the client's
    model with its linear head replaced by the nearest-prototype head over the global prototypes
    it received (a class still without one: the client's own new prototype). ``acc_before``
    scores the client's model with its own linear head. No global model: ``global/*`` is none.

    Down: C*d floats; up: C*d + C. Keeps a full model and C*d prediction prototypes per client.
    Needs ``model.classifier_bias=true`` (the nearest-prototype head needs its bias)."""
    family = "personalized"

    fedavg_weighted = False  # no model aggregated: class prototypes by counts (Method.fedavg_weighted)

    name = "fedproto"
    Options = FedProtoOptions
    source = Source(
        authors="Tan et al.",
        title="FedProto: Federated Prototype Learning across Heterogeneous Clients",
        venue="AAAI",
        year=2022,
        arxiv="2105.00243",
        implements="Eq. 5-7 and Algorithm 1",
        code="yuetan031/fedproto")
    requires_classifier = "linear"
    has_global_model = False
    per_sample_loss = True  # Method.padding_exact
    model_requires = {HEAD + "bias": (True, "model.classifier_bias = true: prediction by nearest prototype is a "
                                            "linear head with a bias")}

    def server_init(self, global_state, info):
        ref = reference_tensor(global_state)
        return {"fedproto.g": torch.full((info.num_classes, info.feature_dim), float("nan"), dtype=ref.dtype,
                                         device=ref.device)}

    def client_init(self, client_id, global_state, info):
        ref = reference_tensor(global_state)
        state = {"fedproto.model." + k: v.clone() for k, v in global_state.items()}
        state["fedproto.predict"] = torch.full((info.num_classes, info.feature_dim), float("nan"),
                                               dtype=ref.dtype, device=ref.device)
        return state

    def broadcast(self, global_state, server_state):
        return {"fedproto.g": server_state["fedproto.g"]}

    def local_start(self, payload, client_state):
        return strip_prefix(client_state, "fedproto.model.")

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, logits = fwd(x)
        reg = prototype_regularizer(z, y, payload["fedproto.g"], fwd.mean)
        return fwd.cross_entropy(logits, y) + self.opt.lam * reg, {"fedproto/reg": reg.detach()}

    def after_training(self, trained, payload, client_state, report: ClientReport):
        z, y = report.local_features(trained)
        means, counts = class_feature_means(z, y, self.info.num_classes)
        own = torch.where((counts > 0)[:, None], means, torch.full_like(means, float("nan")))
        g = payload["fedproto.g"]
        state = {**add_prefix(trained, "fedproto.model."),
                 "fedproto.predict": torch.where(torch.isnan(g[:, :1]), own, g)}
        return {"fedproto.mean": means, "fedproto.count": counts}, state

    def personal_state(self, trained, client_state):
        w, b = nearest_prototype_head(client_state["fedproto.predict"])
        return {**trained, HEAD + "weight": w.to(trained[HEAD + "weight"].dtype), HEAD + "bias": b}

    def aggregate(self, server_state, global_state, uploads, reports):
        counts = [u["fedproto.count"] for u in uploads]
        if self.opt.proto_weighting == "clients":  # every holder of a class weighs 1
            counts = [(c > 0).to(c.dtype) for c in counts]
        g = aggregate_prototypes(server_state["fedproto.g"], [u["fedproto.mean"] for u in uploads], counts)
        return global_state, {"fedproto.g": g}
