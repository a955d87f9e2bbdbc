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
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedskew.algorithms.base import (
    HEAD,
    MODEL,
    ClientReport,
    FedAvgOptions,
    Method,
    Source,
    State,
    add_prefix,
    as_model_part,
    body_names,
    builtin,
    fraction_steps,
    head_names,
    model_part,
    reference_tensor,
    strip_prefix,
    weighted_mean,
)
from fedskew.algorithms.components import BIAS_FREE, RestrictedSoftmax, RSOptions
from fedskew.algorithms.compose import Composed, PartialSharing, options_of
from fedskew.algorithms.tensors import aggregate_prototypes, balanced_softmax_loss, class_feature_means
from fedskew.models.nets import ConditionalPolicy, ConditionalValve, valve_apply
from fedskew.streams import numpy_rng, torch_seed

# ---------------------------------------------------------------------------------------------
# Ditto


class DittoOptions(FedAvgOptions):
    search = {'lam': [0.01, 0.1, 1.0]}  # the bench's search space (fedskew bench)
    lam: float = Field(0.1, ge=0, description="lambda of the proximal term (lambda/2) ||v - w||^2")
    personal_fraction: float = Field(1.0, gt=0, le=10, description="personal steps, as a multiple of the "
                                                                   "E-epoch step budget")


@builtin
class Ditto(Method):
    """Ditto (Li et al., ICML 2021, Algorithm 1). The global update is FedAvg's local training of
    the received model w (uploaded). Then the client's personal model v, kept across rounds
    (initialised as the first received model), trains on h(v) = CE(v) + (lambda/2) ||v - w||^2
    with w the global model it received this round, for ``personal_fraction`` x the E-epoch
    step budget (reference code: as many steps as the global update). The personalised model is v.

    Sends and receives what FedAvg does; keeps v (a full model) per client."""

    name = "ditto"
    Options = DittoOptions
    source = Source(
        authors="Li, Hu, Beirami, Smith",
        title="Ditto: Fair and Robust Federated Learning Through Personalization",
        venue="ICML",
        year=2021,
        arxiv="2012.04221",
        implements="Algorithm 1",
        code="litian96/ditto")
    per_sample_loss = True  # Method.padding_exact

    def client_init(self, client_id, global_state, info):
        return add_prefix({k: v.clone() for k, v in global_state.items()}, "ditto.")

    def split_steps(self, total_steps, lr):
        return total_steps, fraction_steps(total_steps, self.opt.personal_fraction), lr

    def personal_start(self, trained, payload, client_state):
        return strip_prefix(client_state, "ditto.")

    def personal_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        ce = fwd.cross_entropy(logits, y)
        prox = sum((p - payload["model." + k]).pow(2).sum() for k, p in params.items())
        return ce + 0.5 * self.opt.lam * prox, {"ditto/prox": prox.detach()}

    def after_personal(self, personal, payload, client_state, report):
        return add_prefix(personal, "ditto.")

    def personal_state(self, trained, client_state):
        return strip_prefix(client_state, "ditto.")


class DittoRSOptions(RSOptions, DittoOptions):
    renamed = {}


@builtin
class DittoRS(Composed):
    """DittoRS (MAP paper, Table II): Ditto whose global update trains with restricted softmax."""

    name = "dittors"
    Options = DittoRSOptions
    source = Source(
        authors="Li, Song, Li, Li, Shao, Yang, Zhan",
        title="MAP: Model Aggregation and Personalization in Federated Learning with Incomplete Classes (DittoRS, a "
              "Table II baseline)",
        venue="IEEE TKDE (the text in ../shared/papers)",
        year=2024,
        implements="Ditto's Algorithm 1 with MAP Eq. 8 (restricted softmax) on the global update",
        code="lxcnju/FedRepo")
    base_method = Ditto
    model_defaults = BIAS_FREE

    def parts(self, opt):
        return [RestrictedSoftmax(options_of(RSOptions, opt))]


# ---------------------------------------------------------------------------------------------
# FedRep


class FedRepOptions(FedAvgOptions):
    search = {'head_fraction': [0.25, 0.5]}  # the bench's search space (fedskew bench)
    head_fraction: float = Field(0.5, gt=0, lt=1, description="share of the E-epoch step budget spent on the "
                                                              "head (reference code: 9 of 10 epochs)")


@builtin
class FedRep(PartialSharing):
    """FedRep (Collins et al., ICML 2021, Algorithm 1). Each round the client takes the received
    body and its own head; first trains the head with the body frozen (``head_fraction`` of the
    local steps), then the body with the head frozen (the rest). Only the body is uploaded and
    averaged; the head never leaves the client. Personalised model: the new body + own head.
    No global model: the server has no head (``global/*`` is none).

    Down and up: the body (BatchNorm statistics included). Keeps the head per client."""

    name = "fedrep"
    Options = FedRepOptions
    source = Source(
        authors="Collins, Hassani, Mokhtari, Shakkottai",
        title="Exploiting Shared Representations for Personalized Federated Learning",
        venue="ICML",
        year=2021,
        arxiv="2102.07078",
        implements="Algorithm 1",
        code="lgcollins/FedRep")
    requires_classifier = "linear"
    has_global_model = False
    personal_first = True
    keep = "rep."

    def shared(self, key):
        return not key.startswith(HEAD)

    def split_steps(self, total_steps, lr):
        head = min(fraction_steps(total_steps, self.opt.head_fraction), max(total_steps - 1, 0))
        return total_steps - head, head, lr

    def trained_params(self, stage):
        return head_names(self.info) if stage == "personal" else body_names(self.info)

    def after_personal(self, personal, payload, client_state, report):
        return {"rep." + k: v for k, v in personal.items() if k.startswith(HEAD)}


# ---------------------------------------------------------------------------------------------
# FedBABU


class FedBABUOptions(FedAvgOptions):
    search = {'finetune_fraction': [0.5, 1.0]}  # the bench's search space (fedskew bench)
    finetune_fraction: float = Field(1.0, gt=0, le=10, description="fine-tuning steps, as a multiple of the "
                                                                   "E-epoch step budget")


@builtin
class FedBABU(Method):
    """FedBABU (Oh et al., ICLR 2022). During federated training the head stays at its random
    initialisation (never trained, never sent up); clients train and upload the body only. The
    personalised model is the received global model fine-tuned on local data, body and head,
    for ``finetune_fraction`` x the E-epoch step budget at the same learning rate (paper Section
    4: fine-tuning the whole model). The global model is the body with the fixed head.

    Down: the full model; up: the body. Keeps the latest fine-tuned model per client."""

    name = "fedbabu"
    Options = FedBABUOptions
    source = Source(
        authors="Oh, Kim, Yun",
        title="FedBABU: Towards Enhanced Representation for Federated Image Classification",
        venue="ICLR",
        year=2022,
        arxiv="2106.06042",
        implements="Algorithm 1 (body-only training and aggregation, head fine-tuned for personalisation)",
        code="jhoon-oh/FedBABU")
    requires_classifier = "linear"

    def client_init(self, client_id, global_state, info):
        # the latest personalised model (same keys for every client, so clients stack)
        return add_prefix({k: v.clone() for k, v in global_state.items()}, "babu.")

    def split_steps(self, total_steps, lr):
        return total_steps, fraction_steps(total_steps, self.opt.finetune_fraction), lr

    def trained_params(self, stage):
        return None if stage == "personal" else body_names(self.info)

    def after_training(self, trained, payload, client_state, report):
        return as_model_part({k: v for k, v in trained.items() if not k.startswith(HEAD)}), client_state

    def personal_start(self, trained, payload, client_state):
        return model_part(payload)

    def after_personal(self, personal, payload, client_state, report):
        return add_prefix(personal, "babu.")

    def personal_state(self, trained, client_state):
        return strip_prefix(client_state, "babu.")

    def aggregate(self, server_state, global_state, uploads, reports):
        body = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        return {**global_state, **body}, server_state


# ---------------------------------------------------------------------------------------------
# FedROD


@builtin
class FedROD(Method):
    """FedROD (Chen & Chao, ICLR 2022). Shared body + generic head trained with the balanced
    softmax on the client's label counts (uploaded, FedAvg-aggregated: the global model); a
    personal head W_p on the client, its prediction the sum of both heads' logits:
    (W_g + W_p) z (+ b_g + b_p).

    The personal head trains on the generic model's features with plain CE of the summed logits,
    body and generic head frozen. Because the summed logits are linear in W_g + W_p, this is SGD
    on the combined head started from W_g + W_p with only the classifier trainable, and
    W_p = combined - W_g after it. Schedule: it runs after the body's update for the same number of
    steps (the reference interleaves one personal-head step per body step on the current
    features; here every step sees the round's final body). Weight decay, if set, applies to the
    combined head rather than W_p alone. W_p starts at 0 (the personalised model starts as the
    generic one).

    Down/up: the full model (FedAvg); keeps W_p and the round's W_g per client."""

    name = "fedrod"
    Options = FedAvgOptions
    source = Source(
        authors="Chen, Chao",
        title="On Bridging Generic and Personalized Federated Learning for Image Classification",
        venue="ICLR",
        year=2022,
        arxiv="2107.00778",
        implements="Eq. 3 (balanced softmax for the generic head) and the personal head (Section 4)",
        code="hongyouc/Fed-RoD")
    per_sample_loss = True  # Method.padding_exact
    requires_classifier = "linear"

    def client_init(self, client_id, global_state, info):
        state = {"rod.p." + k: torch.zeros_like(v) for k, v in global_state.items() if k.startswith(HEAD)}
        state.update({"rod.g." + k: v.clone() for k, v in global_state.items() if k.startswith(HEAD)})
        state["rod.counts"] = info.class_counts[client_id].to(reference_tensor(global_state))
        return state

    def local_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        return balanced_softmax_loss(logits, y, client_state["rod.counts"], fwd.cross_entropy), {}

    def after_training(self, trained, payload, client_state, report):
        state = {**client_state, **{"rod.g." + k: v for k, v in trained.items() if k.startswith(HEAD)}}
        return as_model_part(trained), state

    def split_steps(self, total_steps, lr):
        return total_steps, total_steps, lr

    def trained_params(self, stage):
        return head_names(self.info) if stage == "personal" else None

    def personal_start(self, trained, payload, client_state):
        return self.personal_state(trained, client_state)

    def after_personal(self, personal, payload, client_state, report):
        new = {"rod.p." + k: v - client_state["rod.g." + k] for k, v in personal.items() if k.startswith(HEAD)}
        return {**client_state, **new}

    def personal_state(self, trained, client_state):
        return {k: v + client_state["rod.p." + k] if k.startswith(HEAD) else v for k, v in trained.items()}


# ---------------------------------------------------------------------------------------------
# FedProto


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


class FedGHOptions(FedAvgOptions):
    search = {"server_lr": [0.1, 1.0]}  # the bench's search space (fedskew bench)
    server_lr: float = Field(1.0, gt=0, description="lr of the server's SGD on the global head (PFLlib's "
                                                    "server_learning_rate default)")


def train_head(weight: torch.Tensor, bias: torch.Tensor | None, protos: torch.Tensor, labels: torch.Tensor,
               lr: float, batch_size: int, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FedGH's server step (Yi et al., 2023, Eq. 5; PFLlib ``servergh.train_head``): one pass of
    plain SGD at ``lr`` over the uploaded (prototype, class) pairs in ``order``, batches of
    ``batch_size`` (the last one smaller), each minimising the batch's mean CE of the linear head."""
    w = weight.detach().clone().requires_grad_(True)
    b = None if bias is None else bias.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            logits = protos[idx] @ w.T + (0 if b is None else b)
            gw, *gb = torch.autograd.grad(F.cross_entropy(logits, labels[idx]), [w] + ([] if b is None else [b]))
            with torch.no_grad():
                w -= lr * gw
                if b is not None:
                    b -= lr * gb[0]
    return w.detach(), None if b is None else b.detach()


@builtin
class FedGH(Method):
    """FedGH (Yi et al., ACM MM 2023): a generalised global header. Every client keeps its whole model;
    at the start of a round it takes the server's global head (Eq. 3), trains body and head on CE,
    then uploads the mean eval-mode feature of each class it holds (Eq. 4). The server trains the
    global head by SGD on the uploaded (prototype, class) pairs, one pass in a seeded random order
    (Eq. 5; PFLlib's ``servergh``: server_learning_rate, the clients' batch size). No shared body:
    no global model (``global/*`` none). The personalised model after a round is the locally
    trained one; what PFLlib evaluates (the own body with the latest global head) is the final
    pass's ``personal/final_acc_before``. PFLlib's server head is client 0's head object (the two
    train each other's head); here they are separate."""

    fedavg_weighted = False  # no model aggregated: the head is trained on the prototypes
    name = "fedgh"
    Options = FedGHOptions
    source = Source(authors="Yi, Wang, Liu, Shi, Yu",
                    title="FedGH: Heterogeneous Federated Learning with Generalized Global Header",
                    venue="ACM MM", year=2023, arxiv="2303.13137",
                    implements="Eq. 3-5 (the global header trained on class prototypes)",
                    code="TsingZ0/PFLlib system/flcore/servers/servergh.py, clients/clientgh.py")
    requires_classifier = "linear"
    has_global_model = False
    per_sample_loss = True  # Method.padding_exact

    def server_init(self, global_state, info):
        return {"fedgh.rounds": torch.zeros((), dtype=torch.long)}

    def client_init(self, client_id, global_state, info):
        return {"fedgh.model." + k: v.clone() for k, v in global_state.items()}

    def broadcast(self, global_state, server_state):
        return {MODEL + k: global_state[k] for k in head_names(self.info)}

    def local_start(self, payload, client_state):
        own = strip_prefix(client_state, "fedgh.model.")
        return {**own, **{k: payload[MODEL + k] for k in head_names(self.info)}}

    def after_training(self, trained, payload, client_state, report: ClientReport):
        z, y = report.local_features(trained)
        means, counts = class_feature_means(z, y, self.info.num_classes)
        return {"fedgh.mean": means, "fedgh.count": counts}, add_prefix(trained, "fedgh.model.")

    def aggregate(self, server_state, global_state, uploads, reports):
        protos = torch.cat([u["fedgh.mean"][u["fedgh.count"] > 0] for u in uploads])
        labels = torch.cat([torch.nonzero(u["fedgh.count"] > 0).flatten() for u in uploads])
        rounds = int(server_state["fedgh.rounds"])
        gen = torch.Generator().manual_seed(torch_seed(self.info.seed, "fedgh_order", rounds))
        order = torch.randperm(len(labels), generator=gen).to(labels.device)
        w, b = train_head(global_state[HEAD + "weight"], global_state.get(HEAD + "bias"), protos, labels,
                          self.opt.server_lr, self.info.batch_size, order)
        new = {**global_state, HEAD + "weight": w}
        if b is not None:
            new[HEAD + "bias"] = b
        return new, {"fedgh.rounds": torch.tensor(rounds + 1)}


# ---------------------------------------------------------------------------------------------
# FedLC


class FedLCOptions(FedAvgOptions):
    search = {'tau': [0.1, 0.5, 1.0]}  # the bench's search space (fedskew bench)
    tau: float = Field(1.0, ge=0, description="calibration strength")


def calibrated_loss(logits: torch.Tensor, y: torch.Tensor, class_counts: torch.Tensor, tau: float,
                    ce=F.cross_entropy) -> torch.Tensor:
    """FedLC (Zhang et al., ICML 2022, Eq. 10): CE of the calibrated logits f_c - tau n_c^(-1/4),
    n_c the client's count of class c; a class it lacks (n_c = 0, an infinite shift in the paper)
    is shifted by tau * 1e3, numerically removed."""
    shift = tau * class_counts.clamp(min=1e-12).pow(-0.25)
    return ce(logits - shift, y)


@builtin
class FedLC(Method):
    """FedLC: FedAvg whose local loss calibrates each logit by the client's label counts before
    the softmax (training only; evaluation uses plain logits). Sends and keeps what FedAvg does."""

    name = "fedlc"
    Options = FedLCOptions
    source = Source(
        authors="Zhang et al.",
        title="Federated Learning with Label Distribution Skew via Logits Calibration",
        venue="ICML",
        arxiv="2209.00189", year=2022,
        implements="Eq. 9 (the calibrated cross-entropy)",
        code="no official code; the paper's Eq. 9")
    per_sample_loss = True  # Method.padding_exact

    def client_init(self, client_id, global_state, info):
        return {"lc.counts": info.class_counts[client_id].to(reference_tensor(global_state))}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        return calibrated_loss(logits, y, client_state["lc.counts"], self.opt.tau, fwd.cross_entropy), {}


# ---------------------------------------------------------------------------------------------
# GPFL


class GPFLOptions(FedAvgOptions):
    search = {"lam": [0.001, 0.01, 0.1]}  # the bench's search space (fedskew bench)
    lam: float = Field(0.01, ge=0, description=
        "lambda, weight of the alignment ||f_G - e_y|| (Frobenius norm over the batch) of the generic features with "
        "the received category embeddings (the authors' run_me.sh for CNNs and MLPs: 0.01)")
    mu: float = Field(0.1, ge=0, description=
        "L2 penalty (mu/2) ||theta||^2 on the valve and the category embeddings (the authors' optimisers' weight "
        "decay for them; run_me.sh for CNNs and MLPs: 0.1)")


@builtin
class GPFL(PartialSharing):
    """GPFL (Zhang et al., ICCV 2023, "GPFL: Simultaneously Learning Global and Personalized Feature
    Information"; TsingZ0/GPFL ``clientgp.py``, ``servergp.py``, ``run_me.sh``; PFLlib's
    ``clientgpfl.py`` is the same arithmetic). The model gets a conditional valve (CoV) between the
    features z and the classifier and global category embeddings (GCE) e_1..e_C
    (``GPFL.build_model``). Client k's loss:
    CE(head_k(CoV(z, p_k)), y) + CE(cos(CoV(z, g_k), e), y) + lam ||CoV(z, g_k) - e'_y|| + (mu/2)
    ||theta_CoV, GCE||^2, with e the embeddings being trained, e' the received ones (frozen), cos
    the cosine similarity without temperature, the norm the Frobenius norm over the batch (the
    official ``torch.norm(feat_G - emb, 2)``), and the conditional inputs p_k = sum_c (n_k,c / n_k)
    e^k_c (personalised) and g_k = mean_c e^k_c (generic) from the embeddings e^k the client
    trained in its previous round (zero before its first), as the official ``set_GCE`` computes
    them from the client's own GCE before it takes the global one. The body, the CoV and the GCE are sent and
    averaged (sample weights); the head stays on the client. Personalised model: the body and CoV
    with the client's head and p_k; no global model (no global head).

    Differences: the official CoV and GCE have their own SGD optimisers (weight decay mu, no
    momentum) and the rest SGD without weight decay; here one optimiser of the run's settings
    trains all, mu as a loss term (the same gradient; ``train/loss`` includes it). The official
    server refreshes every client's conditional inputs each round, a client not selected from the
    global embeddings it holds; here a client keeps those of its last round until it is selected
    again (the same under full participation). Down and up: body + CoV (2 d^2 + 6 d) + GCE
    (C d). Keeps the head, p_k, g_k and its label shares."""

    name = "gpfl"
    Options = GPFLOptions
    source = Source(
        authors="Zhang et al.",
        title="GPFL: Simultaneously Learning Global and Personalized Feature Information for Personalized Federated "
              "Learning",
        venue="ICCV",
        year=2023,
        arxiv="2308.10279",
        implements="the conditional valve and the global category embeddings (the paper's Section 4)",
        code="TsingZ0/GPFL")
    requires_classifier = "linear"
    has_global_model = False
    keep = "gpfl.own."

    @classmethod
    def build_model(cls, model, options, rebuild):
        """The conditional valve (CoV) between the features and the classifier, then the global
        category embeddings (GCE), one row per class."""
        model.valve = ConditionalValve(model.feature_dim)
        model.gce = nn.Embedding(model.classifier.out_features, model.feature_dim)
        return model

    def shared(self, key):
        return not key.startswith(HEAD) and key != "valve.context"

    def client_init(self, client_id, global_state, info):
        counts = info.class_counts[client_id].to(global_state["gce.weight"])
        zeros = torch.zeros_like(global_state["gce.weight"][0])  # the authors' conditional inputs before set_GCE
        return {**super().client_init(client_id, global_state, info), "gpfl.share": counts / counts.sum(),
                "gpfl.p": zeros, "gpfl.g": zeros.clone()}

    def local_start(self, payload, client_state):
        """The received body, CoV and GCE, the client's head, and p_k as the valve's context."""
        return {**super().local_start(payload, client_state), "valve.context": client_state["gpfl.p"]}

    def after_training(self, trained, payload, client_state, report):
        """Keeps the head and the next round's conditional inputs p_k = share_k . e, g = mean_c e_c
        from the client's own trained embeddings (the authors' ``set_GCE`` reads the client's GCE
        before overwriting it with the global one)."""
        upload, kept = super().after_training(trained, payload, client_state, report)
        e = trained["gce.weight"]
        return upload, {**kept, "gpfl.share": client_state["gpfl.share"], "gpfl.p": client_state["gpfl.share"] @ e,
                        "gpfl.g": e.mean(0)}

    def personal_state(self, trained, client_state):
        """The trained model with the conditional input it will use next (the official clients are
        evaluated after ``set_GCE``)."""
        return {**trained, "valve.context": client_state["gpfl.p"]}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, logits = fwd(x)  # head(CoV(z, p_k)): p_k is the valve's context
        received = payload[MODEL + "gce.weight"]  # the official GCE_frozen
        valve = {k[len("valve."):]: v for k, v in params.items() if k.startswith("valve.")}
        generic = valve_apply(z, client_state["gpfl.g"], valve)
        embeddings = params["gce.weight"]
        gce = fwd.cross_entropy(F.linear(F.normalize(generic, dim=-1), F.normalize(embeddings, dim=-1)), y)
        align = torch.linalg.vector_norm(generic - received[y])
        l2 = sum(v.pow(2).sum() for v in valve.values()) + embeddings.pow(2).sum()
        loss = fwd.cross_entropy(logits, y) + gce + self.opt.lam * align + 0.5 * self.opt.mu * l2
        return loss, {"gpfl/gce": gce.detach(), "gpfl/align": align.detach()}


# ---------------------------------------------------------------------------------------------
# FedCP


def mmd_rbf(x: torch.Tensor, y: torch.Tensor, bandwidths=(10.0, 15.0, 20.0, 50.0)) -> torch.Tensor:
    """FedCP's MMD between two batches of features (TsingZ0/FedCP ``MMD(x, y, 'rbf')``): the mean
    over all pairs of sum_a [exp(-||x_i - x_j||^2 / 2a) + exp(-||y_i - y_j||^2 / 2a) - 2
    exp(-||x_i - y_j||^2 / 2a)], squared distances from the Gram matrices as the official code
    computes them, fixed bandwidths a (not scaled to the data)."""
    xx, yy, zz = x @ x.T, y @ y.T, x @ y.T
    rx, ry = xx.diagonal().unsqueeze(0).expand_as(xx), yy.diagonal().unsqueeze(0).expand_as(yy)
    dxx, dyy, dxy = rx.T + rx - 2 * xx, ry.T + ry - 2 * yy, rx.T + ry - 2 * zz
    k = sum(torch.exp(-0.5 * dxx / a) + torch.exp(-0.5 * dyy / a) - 2 * torch.exp(-0.5 * dxy / a) for a in bandwidths)
    return k.mean()


class FedCPOptions(FedAvgOptions):
    search = {"lam": [0.5, 5.0, 50.0]}  # the bench's search space (fedskew bench)
    lam: float = Field(5.0, ge=0, description=
        "lambda, weight of the MMD between the features of the trained body and of the received global body "
        "(frozen) (the authors' run_me.sh: 5; main.py's default 0)")


@builtin
class FedCP(PartialSharing):
    """FedCP (Zhang et al., KDD 2023, "FedCP: Separating Feature Information for Personalized
    Federated Learning via Conditional Policy"; TsingZ0/FedCP ``clientcp.py``, ``servercp.py``,
    ``run_me.sh``; PFLlib's ``clientcp.py`` is the same arithmetic). The model gets a conditional
    policy network (CPN) and a global head beside the client's head (``FedCP.build_model``,
    :class:`~fedskew.models.nets.ConditionalPolicy`): per sample, a Gumbel-softmax
    policy splits the features z into z * s_p for the client's head and z * s_g for the global
    head, conditioned on the client's context c = the row sum of its head's weights. Client k's
    loss: CE(head_p(z s_p) + head_g(z s_g), y) + lam MMD(z, z_G), z_G the received body's features
    of the same batch (frozen), MMD with the official fixed RBF bandwidths (:func:`mmd_rbf`). The
    global head is not trained locally. Up: the body, the CPN and head_g' = (head_p + head_g) / 2
    (the official ``generate_upload_head``); the server averages them (sample weights). The client
    keeps its head and its context, set after training from the trained head (the official
    ``set_head_g``); before its first round the context is uniform in [0, 1)^d (the official
    ``torch.rand``; stream ``fedcp_context``). No global model: the policy needs a client's head.

    Differences: one optimiser of the run's settings (the official plain SGD is momentum 0, no
    weight decay); the received body's features for the MMD come from an eval-mode pass (the
    official frozen copy runs in train mode: the same without BatchNorm). The official server
    sends the new body to every client each round but the new CPN and global head only to that
    round's clients; here a client gets all three when selected (the same under full
    participation, the official protocol). The official evaluation scores the received body, CPN
    and global head with the client's head and context, which is fedskew's ``personal/acc_before``;
    ``personal/acc_after`` scores the trained model. The Gumbel noise makes the method random in
    training and evaluation, so the vectorised executor runs it sequentially."""

    name = "fedcp"
    Options = FedCPOptions
    source = Source(
        authors="Zhang et al.",
        title="FedCP: Separating Feature Information for Personalized Federated Learning via Conditional Policy",
        venue="KDD",
        arxiv="2307.01217", year=2023,
        implements="the conditional policy network and its feature split (the paper's Section 4)",
        code="TsingZ0/FedCP")
    requires_classifier = "linear"
    has_global_model = False
    vectorizable = False  # Gumbel noise (random masks under vmap cannot match the sequential executor's)
    keep = "fedcp.own."

    @classmethod
    def build_model(cls, model, options, rebuild):
        """The conditional policy network (CPN) and a global head equal to the head at first (the
        official ``head_g = deepcopy(head)``)."""
        head = model.classifier
        model.policy = ConditionalPolicy(model.feature_dim, head.out_features, head.bias is not None)
        model.policy.head_g.load_state_dict(head.state_dict())
        return model

    def shared(self, key):
        return not key.startswith(HEAD) and key != "policy.context"

    def client_init(self, client_id, global_state, info):
        gen = torch.Generator().manual_seed(torch_seed(info.seed, "fedcp_context", client_id))
        context = torch.rand(global_state["policy.context"].shape, generator=gen).to(global_state["policy.context"])
        return {**super().client_init(client_id, global_state, info), self.keep + "policy.context": context}

    def trained_params(self, stage):
        return frozenset(k for k in self.info.param_names if not k.startswith("policy.head_g."))

    def after_training(self, trained, payload, client_state, report):
        """Uploads the body, the CPN and (head_p + head_g) / 2; keeps the trained head and the next
        context, the row sum of its weights."""
        upload, kept = super().after_training(trained, payload, client_state, report)
        for name in ("weight", "bias"):
            if HEAD + name in trained:
                upload[MODEL + "policy.head_g." + name] = (
                    0.5 * trained[HEAD + name] + 0.5 * trained["policy.head_g." + name]
                )
        return upload, {**kept, self.keep + "policy.context": trained[HEAD + "weight"].sum(0)}

    def personal_state(self, trained, client_state):
        """The trained model with the context it will use next."""
        return {**trained, "policy.context": client_state[self.keep + "policy.context"]}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, logits = fwd(x)
        z_global, _ = fwd.frozen(model_part(payload), x)
        mmd = mmd_rbf(z, z_global)
        return fwd.cross_entropy(logits, y) + self.opt.lam * mmd, {"fedcp/mmd": mmd.detach()}


__all__ = [
    "FedCP",
    "GPFL",
    "Ditto",
    "DittoRS",
    "FedBABU",
    "FedLC",
    "FedProto",
    "FedROD",
    "FedRep",
    "balanced_softmax_loss",
    "calibrated_loss",
    "mmd_rbf",
    "nearest_prototype_head",
    "prototype_regularizer",
]


# ---------------------------------------------------------------------------------------------
# FedEM


MIX = "classifier.mix"  # the mixture weights pi (MixtureNet's buffer)


class FedEMOptions(FedAvgOptions):
    search = {"learners": [2, 3, 5]}  # the bench's search space (fedskew bench)
    learners: int = Field(3, ge=1, le=16, description="M, the mixture's components (models of the configured "
                                                      "architecture, each its own initialisation)")


@builtin
class FedEM(Method):
    """FedEM (Marfoq, Neglia, Bellet, Kameni, Vidal, NeurIPS 2021, Algorithm 1): every client's
    data is a mixture of M shared components, p_k(y|x) = sum_m pi_km p_m(y|x); the model is the M
    components (:class:`~fedskew.models.nets.MixtureNet`), the client keeps its weights pi_k. Each
    round, before training (E-step, ``prepare``): q_i(m) = softmax_m(log pi_km - CE(theta_m; x_i,
    y_i)) over the client's samples under the received components (eval mode), then pi_k <- mean_i
    q_i. Local training (M-step): the batch mean of sum_m q_i(m) CE(theta_m; x_i, y_i), q_i computed
    from the received components (FL-bench's per-sample weights: the same numbers). The server
    averages the components as FedAvg; the global model's pi is the n_k-weighted mean of the
    round's pi_k (the mixture the population would use), the personalised model the components
    with the client's own pi_k."""

    name = "fedem"
    Options = FedEMOptions
    source = Source(authors="Marfoq, Neglia, Bellet, Kameni, Vidal",
                    title="Federated Multi-Task Learning under a Mixture of Distributions",
                    venue="NeurIPS", year=2021, arxiv="2108.10252",
                    implements="Algorithm 1 (E-step over the local samples, pi update, weighted M-step; FedAvg of "
                               "the components)",
                    code="KarhouTam/FL-bench src/client/fedem.py, src/server/fedem.py (n_learners 3)")
    requires_classifier = "linear"
    per_sample_loss = True  # Method.padding_exact

    @classmethod
    def build_model(cls, model, options, rebuild):
        """M components: the configured model and M - 1 more draws of its configuration."""
        from fedskew.models.nets import MixtureNet

        return MixtureNet([model, *(rebuild() for _ in range(options.learners - 1))])

    def client_init(self, client_id, global_state, info):
        uniform = torch.full_like(global_state[MIX], 1.0 / len(global_state[MIX]))
        return {"em.pi": uniform, "em.prior": uniform}

    def responsibilities(self, per_learner_logits, y, prior):
        """q_i(m) = softmax_m(log pi_m - CE(theta_m; x_i, y_i)) from the learners' logits [B, M C]."""
        m = len(prior)
        logp = F.log_softmax(per_learner_logits.reshape(len(y), m, -1), -1)
        nll = -logp.gather(2, y[:, None, None].expand(-1, m, 1)).squeeze(2)  # [B, M]
        return torch.softmax(torch.log(prior) - nll, 1), nll

    def prepare(self, payload, client_state, data):
        with torch.no_grad():
            z, _ = data.frozen(model_part(payload), data.x)
            q, _ = self.responsibilities(z, data.y, client_state["em.pi"].to(z))
        return {**client_state, "em.prior": client_state["em.pi"], "em.pi": q.mean(0).to(client_state["em.pi"])}

    def local_start(self, payload, client_state):
        return {**model_part(payload), MIX: client_state["em.pi"]}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, _ = fwd(x)
        z0, _ = fwd.frozen(model_part(payload), x)
        q, _ = self.responsibilities(z0, y, client_state["em.prior"])
        _, nll = self.responsibilities(z, y, client_state["em.prior"])
        return fwd.mean((q.detach() * nll).sum(1)), {}

    def personal_state(self, trained, client_state):
        return {**trained, MIX: client_state["em.pi"]}


# ---------------------------------------------------------------------------------------------
# kNN-Per

STORE = ("knn.keys", "knn.labels", "knn.valid")


class KNNPerOptions(FedAvgOptions):
    search = {"weight": [0.3, 0.5, 0.7], "k": [5, 10]}  # the bench's search space (fedskew bench)
    k: int = Field(5, ge=1, description="neighbours of each test sample in the datastore")
    weight: float = Field(0.5, ge=0, le=1, description="lambda, the weight of the kNN distribution in the "
                                                       "interpolation")
    scale: float = Field(1.0, gt=0, description="kernel width: a neighbour at squared distance d weighs "
                                                "exp(-d / (dim scale))")
    capacity: int = Field(500, ge=1, le=100_000, description="rows of the datastore; a client with more training "
                                                             "samples stores a seeded random subset")
    mix: Literal["probabilities", "logits"] = Field(
        "probabilities", description="interpolate the kNN distribution with the model's probabilities (the paper's "
                                     "Eq. 3) or with its raw logits (FL-bench's evaluate)")


@builtin
class KNNPer(Method):
    """kNN-Per (Marfoq, Neglia, Vidal, Kameni, ICML 2022): FedAvg trains the global model;
    a client personalises it at inference by interpolating its output with a kNN distribution over
    a datastore of its own training samples' features under that model (:class:`~fedskew.models.
    nets.KNNNet`). Before a client's training (``prepare``) its datastore is built with the
    received model, so the round's received model (``personal/acc_before``, and the final pass's
    ``final_acc_before``) is the paper's personalised model; after training it is rebuilt with the
    trained model for ``personal/acc_after``. The uploads carry an empty datastore: the global
    model is FedAvg's alone."""

    @classmethod
    def inert(cls, options, rounds, num_clients, clients_per_round):
        if options.scale < 1e-6:
            return (f"scale = {options.scale:g}: a neighbour at squared distance d weighs exp(-d / (dim scale)), "
                    f"which underflows to 0 for all but identical features, so the kNN part of the output vanishes")

    name = "knnper"
    Options = KNNPerOptions
    source = Source(authors="Marfoq, Neglia, Kameni, Vidal",
                    title="Personalized Federated Learning through Local Memorization",
                    venue="ICML", year=2022, arxiv="2111.09360",
                    implements="Sec. 3 (FedAvg, then the local datastore and Eq. 3's interpolation)",
                    code="KarhouTam/FL-bench src/client/knnper.py, src/server/knnper.py (k 5, weight 0.5, scale 1, "
                         "capacity 500)")
    requires_classifier = "linear"
    per_sample_loss = True  # Method.padding_exact

    @classmethod
    def build_model(cls, model, options, rebuild):
        """The model and an empty datastore of ``capacity`` rows."""
        from fedskew.models.nets import KNNNet

        o = options
        return KNNNet(model, o.capacity, o.k, o.weight, o.scale, o.mix)

    def datastore(self, z: torch.Tensor, y: torch.Tensor, like: State, client_id: int) -> State:
        """The ``knn.*`` buffers holding (z, y): every sample, or ``capacity`` of them drawn from the
        seed and the client (the same rows every time)."""
        cap = like["knn.valid"].shape[0]
        rows = torch.arange(len(y))
        if len(y) > cap:
            rows = torch.from_numpy(numpy_rng(self.info.seed, "knnper", client_id).choice(len(y), cap, replace=False))
        keys, labels, valid = (torch.zeros_like(like[k]) for k in STORE)
        keys[:len(rows)] = z[rows].to(keys)
        labels[torch.arange(len(rows)), y[rows].long()] = 1
        valid[:len(rows)] = 1
        return {"knn.keys": keys, "knn.labels": labels, "knn.valid": valid}

    def prepare(self, payload, client_state, data):
        glob = model_part(payload)
        z, _ = data.frozen(glob, data.x)
        return {**client_state, **self.datastore(z, data.y, glob, data.client_id)}

    def local_start(self, payload, client_state):
        return {**model_part(payload), **{k: client_state[k] for k in STORE if k in client_state}}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        """FedAvg's loss on the model's own logits (the datastore serves inference only)."""
        z, _ = fwd(x)
        return fwd.cross_entropy(fwd.head(z), y), {}

    def after_training(self, trained, payload, client_state, report):
        empty = {k: torch.zeros_like(trained[k]) for k in STORE}
        z, y = report.local_features(trained)
        return as_model_part({**trained, **empty}), self.datastore(z, y, trained, report.client_id)

    def personal_state(self, trained, client_state):
        return {**trained, **{k: client_state[k] for k in STORE if k in client_state}}


# ---------------------------------------------------------------------------------------------
# Floco


class FlocoOptions(FedAvgOptions):
    search = {"rho": [0.05, 0.1, 0.2], "tau": [5, 10]}  # the bench's search space (fedskew bench)
    endpoints: int = Field(10, ge=2, le=64, description="M, the simplex's endpoints (classifier weights)")
    tau: int = Field(10, ge=1, description="the round (from 0) before which the clients are projected onto the "
                                           "simplex")
    rho: float = Field(0.1, ge=0, description="radius of each client's L1 ball around its projected point")


def simplex_projection(kappas: np.ndarray, z: float) -> np.ndarray:
    """Each row of ``kappas`` projected onto the simplex {b >= 0, sum b = z} (FL-bench's
    ``_project_client_onto_simplex``, the sort-based Euclidean projection)."""
    ordered = np.sort(kappas, axis=1)[:, ::-1]
    cssv = np.cumsum(ordered, axis=1) - z
    ind = np.arange(kappas.shape[1]) + 1
    count = np.count_nonzero(ordered - cssv / ind > 0, axis=1)
    theta = cssv[np.arange(len(kappas)), count - 1] / count
    return np.maximum(kappas - theta[:, None], 0)


def riesz_log_energy(points: np.ndarray) -> float:
    """log(mean over pairs of 1 / ||b_i - b_j||^2), distances floored at 1e-4 (FL-bench's
    ``_riesz_s_energy``): low when the points spread over the simplex."""
    dist = np.sqrt(((points[:, None] - points[None, :]) ** 2).sum(2))
    pairs = np.maximum(dist[np.triu_indices(len(points), 1)], 1e-4)
    return float(np.log((1 / pairs ** 2).sum()) - np.log(len(pairs)))


def project_clients(signatures: np.ndarray, endpoints: int) -> np.ndarray:
    """Floco's projection (FL-bench's ``project_clients``): the clients' classifier endpoints
    reduced by PCA to M dimensions (``svd_solver='full'``: deterministic; fewer clients than M: the
    missing components are 0), projected onto simplices of sizes z in linspace(1e-4, 1, 1000), each
    row renormalised; the z whose points have the lowest Riesz energy wins."""
    from sklearn.decomposition import PCA

    k = min(endpoints, len(signatures))
    kappas = np.zeros((len(signatures), endpoints))
    kappas[:, :k] = PCA(n_components=k, svd_solver="full").fit_transform(signatures)
    best, lowest = None, np.inf
    for z in np.linspace(1e-4, 1, 1000):
        betas = simplex_projection(kappas, z)
        betas = betas / betas.sum(1, keepdims=True)
        energy = riesz_log_energy(betas) if len(betas) > 1 else 0.0
        if np.isfinite(energy) and energy < lowest:
            best, lowest = betas, energy
    return best


@builtin
class Floco(Method):
    """Floco (Grinwald, Wiesner, Nakajima, NeurIPS 2024), as FL-bench's ``floco`` runs
    it: the classifier is a simplex of M endpoint weights (:class:`~fedskew.models.nets.
    SimplexLinear`), trained at a random point of the simplex every step; FedAvg averages the whole
    model. After round tau - 1 the server projects the clients onto the simplex by their trained
    endpoints (``project_clients``); from then on each client trains at random points of the L1 ball
    of radius rho around its own point beta_k, and its personalised model is the classifier at
    beta_k. The global model is the classifier at the simplex's centre."""

    @classmethod
    def inert(cls, options, rounds, num_clients, clients_per_round):
        if options.tau >= rounds:
            return (f"tau = {options.tau} is not below rounds = {rounds}: the clients are never projected onto "
                    f"their subregions of the simplex")

    name = "floco"
    Options = FlocoOptions
    source = Source(authors="Grinwald, Wiesner, Nakajima",
                    title="Federated Learning over Connected Modes", venue="NeurIPS", year=2024, arxiv="2403.03333",
                    implements="Floco (solution simplex, projection of the clients by their endpoint weights, "
                               "subregion training); not Floco+ (pers_epoch 0, FL-bench's default)",
                    code="KarhouTam/FL-bench src/server/floco.py, src/client/floco.py (endpoints 10, tau 10, rho 0.1)")
    requires_classifier = "linear"
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss)

    @classmethod
    def build_model(cls, model, options, rebuild):
        """The classifier becomes M endpoints, each Xavier-normal (FL-bench's ``_initialize_weight``),
        with the configured classifier's bias."""
        head = model.classifier
        ends = torch.stack([nn.init.xavier_normal_(torch.empty_like(head.weight)) for _ in range(options.endpoints)])
        bias = head.bias.detach().clone() if head.bias is not None else torch.zeros(head.out_features)
        from fedskew.models.nets import SimplexLinear

        model.classifier = SimplexLinear(ends, bias)
        return model

    def server_init(self, global_state, info):
        ends = global_state["classifier.endpoints"]
        m = ends.shape[0]
        return {"floco.signatures": torch.zeros(info.num_clients, ends.numel(), dtype=ends.dtype),
                "floco.seen": torch.zeros(info.num_clients, dtype=torch.bool),
                "floco.center": torch.full((info.num_clients, m), 1.0 / m, dtype=ends.dtype),
                "floco.on": torch.zeros(info.num_clients, dtype=ends.dtype),
                "floco.round": torch.zeros((), dtype=torch.long)}

    def download(self, server_state, client_id, round_idx):
        return {
            "floco.center": server_state["floco.center"][client_id],
            "floco.on": server_state["floco.on"][client_id],
        }

    def _subregion(self, state, client_state):
        on = client_state["floco.on"]
        return {**state, "classifier.center": client_state["floco.center"], "classifier.projected": on,
                "classifier.radius": on * self.opt.rho}

    def local_start(self, payload, client_state):
        return self._subregion(model_part(payload), client_state)

    def after_training(self, trained, payload, client_state, report):
        glob = model_part(payload)
        shared = {**trained, **{k: glob[k] for k in ("classifier.center", "classifier.projected", "classifier.radius")}}
        return as_model_part(shared), client_state

    def personal_state(self, trained, client_state):
        return self._subregion(trained, client_state)

    def aggregate(self, server_state, global_state, uploads, reports):
        new = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        state = {k: v.clone() for k, v in server_state.items()}
        for u, r in zip(uploads, reports):
            state["floco.signatures"][r.client_id] = u[MODEL + "classifier.endpoints"].reshape(-1).cpu()
            state["floco.seen"][r.client_id] = True
        state["floco.round"] = server_state["floco.round"] + 1
        if int(state["floco.round"]) == self.opt.tau:  # FL-bench projects when its round counter reaches tau
            seen = torch.nonzero(state["floco.seen"]).flatten()
            betas = project_clients(state["floco.signatures"][seen].double().numpy(), self.opt.endpoints)
            state["floco.center"][seen] = torch.from_numpy(betas).to(state["floco.center"])
            state["floco.on"][seen] = 1
        return new, state
