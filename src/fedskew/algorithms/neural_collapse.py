"""Neural-collapse FL: a fixed simplex-ETF classifier shared by all parties
plus global memory vectors (GMV) that pull each sample's feature toward its class's global mean.

The ETF head itself is a model option (``model.classifier=etf``, :class:`fedskew.models.nets.
ETFClassifier`), so every method that leaves the classifier alone runs with it
(``method=scaffold model.classifier=etf``). This module adds the memory vectors, ``etf_gmv``,
FedETF (Li et al., ICCV 2023), ``fedetf``, and FedGELA (Fan et al., NeurIPS 2023), ``fedgela``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedskew.algorithms.base import (
    ClientReport,
    FedAvgOptions,
    Method,
    Source,
    add_prefix,
    builtin,
    fraction_steps,
    head_names,
    reference_tensor,
    strip_prefix,
)
from fedskew.algorithms.tensors import aggregate_prototypes, balanced_softmax_loss, class_feature_means


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

    name = "etf_gmv"
    Options = EtfGmvOptions
    source = Source(
        authors="Huang, Xie, Yang, Wang, Lin, Cai",
        title="Neural Collapse Inspired Federated Learning with Non-iid Data",
        venue="arXiv preprint (its text in ../shared/papers names no venue)",
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


# ---------------------------------------------------------------------------------------------
# FedETF


class FedETFOptions(FedAvgOptions):
    finetune_fraction: float = Field(1.0, ge=0, le=10, description="personalisation: steps fine-tuning the "
                                                                   "projector and temperature, as a multiple of "
                                                                   "the E-epoch step budget (0: none)")


@builtin
class FedETF(Method):
    """FedETF (Li et al., ICCV 2023; reference ZexiLee/ICCV-2023-FedETF). The model's head is a
    trainable linear projector, L2 normalisation, the fixed simplex ETF (shared from the seed, never
    sent) and a learnable temperature beta: logits = beta * M^T normalise(W_p z + b_p)
    (``model.etf_projector``, ``etf_normalize``, ``etf_learn_scale``; beta starts at
    ``model.etf_scale``, 10 by default here as in the reference's CNN). Local training minimises the
    balanced softmax loss with the client's class counts (CE of logits + log n_c; the reference's
    ``balanced_softmax_loss``); body, projector and beta are averaged as in FedAvg (the global
    model). Personalisation (the reference's local fine-tuning, on the locally trained model): CE
    on the projector and beta only, for ``finetune_fraction`` x the E-epoch step budget. Largest
    difference from the reference: it alternates 3 epochs on the ETF matrix itself (lr 0.1) and 3 on
    the projector (lr 0.05), 20 times, once after training; here the ETF stays fixed (a buffer every
    party derives from the seed) and the projector's fine-tuning runs every round at the local lr.

    Sends and keeps what FedAvg does (the ETF is never sent); keeps the fine-tuned projector and
    beta per client."""

    name = "fedetf"
    Options = FedETFOptions
    source = Source(
        authors="Li et al.",
        title="No Fear of Classifier Biases: Neural Collapse Inspired Federated Learning with Synthetic and Fixed "
              "Classifier",
        venue="ICCV",
        year=2023,
        arxiv="2303.10058",
        implements="the projector, the fixed ETF classifier with a learnable temperature, and the local fine-tuning "
                   "(Section 4)",
        code="ZexiLee/ICCV-2023-FedETF")
    requires_classifier = "etf"
    model_defaults = {"classifier": "etf", "etf_projector": True, "etf_normalize": True, "etf_learn_scale": True,
                      "etf_scale": 10.0}
    per_sample_loss = True  # Method.padding_exact
    model_requires = {"classifier.projector.weight": (True, "model.etf_projector = true (its defaults set it; a "
                                                            "config set it to false)")}

    def client_init(self, client_id, global_state, info):
        head = {k: v.clone() for k, v in global_state.items() if k in head_names(self.info)}
        return {**add_prefix(head, "fedetf.p."), "fedetf.counts": info.class_counts[client_id].to(
            reference_tensor(global_state))}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        return balanced_softmax_loss(logits, y, client_state["fedetf.counts"], fwd.cross_entropy), {}

    def split_steps(self, total_steps, lr):
        return total_steps, fraction_steps(total_steps, self.opt.finetune_fraction), lr

    def trained_params(self, stage):
        return head_names(self.info) if stage == "personal" else None

    def after_personal(self, personal, payload, client_state, report):
        return {**client_state, **add_prefix({k: personal[k] for k in head_names(self.info)}, "fedetf.p.")}

    def personal_state(self, trained, client_state):
        if self.opt.finetune_fraction == 0:
            return trained
        return {**trained, **strip_prefix(client_state, "fedetf.p.")}


__all__ = ["EtfGmv", "FedETF", "aggregate_memory_vectors", "memory_features"]


# ---------------------------------------------------------------------------------------------
# FedGELA


def gela_scales(counts: torch.Tensor) -> torch.Tensor:
    """E_w [C] of one client: C n_c / n (0 for a class it lacks), the official ``produce_Ew``."""
    counts = counts.double()
    return (counts.shape[0] * counts / counts.sum()).float()


class FedGELAOptions(FedAvgOptions):
    search = {'gela_temperature': [0.1, 0.2, 0.5]}  # the bench's search space (fedskew bench)
    weighting: Literal["samples", "batches", "uniform"] = Field(
        "batches", description="aggregation weights p_k; batches: the official code's len(dataloader)")
    gela_temperature: float = Field(0.2, gt=0, description="T in the local logits z E_w M / T; 0.2 is the official "
                                                           "argparse default (its README's command uses 1e-5)")


@builtin
class FedGELA(Method):
    """FedGELA (Fan et al., NeurIPS 2023, "bilateral curation for partially class-disjoint data";
    official code MediaBrain-SJTU/FedGELA ``FedGELA.py``): the fixed simplex ETF M is the global
    classifier (``model.classifier=etf``); client k trains with its locally adapted classifier
    E_w,k * M, logits (z M) * E_w / T (:func:`gela_scales`: classes it lacks get logit 0) and CE,
    and its personalised model predicts with E_w * M (the head of its state scaled, overriding the
    fixed ETF buffer: ``FederationInfo.fixed_state``). The global model predicts with M. Keeps
    ``gela.ew`` [C] per client; communication as FedAvg (the head is never sent)."""

    name = "fedgela"
    Options = FedGELAOptions
    # the official train_net clips every step's gradient at norm 20 (FedGELA.py, clip_grad_norm_(..., 20)),
    # whatever the command; where the config leaves grad_clip unset (digits' first gradient norms reach 45)
    run_defaults = {"grad_clip": 20.0}
    source = Source(
        authors="Fan et al.",
        title="Federated Learning with Bilateral Curation for Partially Class-Disjoint Data",
        venue="NeurIPS",
        arxiv="2405.18972", year=2023,
        implements="the global ETF classifier and each client's locally adapted one (the paper's Section 4)",
        code="MediaBrain-SJTU/FedGELA")
    requires_classifier = "etf"
    model_defaults = {"classifier": "etf"}
    per_sample_loss = True  # Method.padding_exact

    def client_init(self, client_id, global_state, info):
        device = reference_tensor(global_state).device
        return {"gela.ew": gela_scales(info.class_counts[client_id]).to(device)}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        return fwd.cross_entropy(logits * client_state["gela.ew"] / self.opt.gela_temperature, y), {}

    def personal_state(self, trained, client_state):
        head = self.info.fixed_state["classifier.weight"]  # [C, d]: logits = z @ head^T
        return {**trained, "classifier.weight": client_state["gela.ew"][:, None].to(head) * head.to(
            client_state["gela.ew"].device)}
