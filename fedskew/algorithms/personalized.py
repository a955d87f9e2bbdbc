"""Personalised-FL baselines of the MAP paper's Table II (docs/methods.md, "Baselines"): Ditto, FedRep,
FedBABU, FedROD, FedProto, and FedLC's calibrated loss; and GPFL (issue 34).

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
=========  ======================================================  ==========================

The head is ``classifier.*`` (the final linear layer), the body every other parameter.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import (HEAD, MODEL, ClientReport, FedAvgOptions, Method, add_prefix, as_model_part, body_names,
                                  fraction_steps, head_names, model_part, reference_tensor, strip_prefix,
                                  weighted_mean)
from fedskew.algorithms.components import BIAS_FREE, RestrictedSoftmax, RSOptions
from fedskew.algorithms.compose import Composed, PartialSharing, options_of
from fedskew.algorithms.tensors import aggregate_prototypes, balanced_softmax_loss, class_feature_means
from fedskew.models.nets import valve_apply

# ---------------------------------------------------------------------------------------------
# Ditto


class DittoOptions(FedAvgOptions):
    search = {'lam': [0.01, 0.1, 1.0]}  # the bench's search space (fedskew bench)
    lam: float = Field(0.1, ge=0, description="lambda of the proximal term (lambda/2) ||v - w||^2")
    personal_fraction: float = Field(1.0, gt=0, le=10, description="personal steps, as a multiple of the "
                                                                   "E-epoch step budget")


class Ditto(Method):
    """Ditto (Li et al., ICML 2021, Algorithm 1). The global update is FedAvg's local training of
    the received model w (uploaded). Then the client's personal model v, kept across rounds
    (initialised as the first received model), trains on h(v) = CE(v) + (lambda/2) ||v - w||^2
    with w the global model it received this round, for ``personal_fraction`` x the E-epoch
    step budget (reference code: as many steps as the global update). The personalised model is v.

    Sends and receives what FedAvg does; keeps v (a full model) per client."""

    name = "ditto"
    Options = DittoOptions
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


class DittoRS(Composed):
    """DittoRS (MAP paper, Table II): Ditto whose global update trains with restricted softmax."""

    name = "dittors"
    Options = DittoRSOptions
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


class FedRep(PartialSharing):
    """FedRep (Collins et al., ICML 2021, Algorithm 1). Each round the client takes the received
    body and its own head; first trains the head with the body frozen (``head_fraction`` of the
    local steps), then the body with the head frozen (the rest). Only the body is uploaded and
    averaged; the head never leaves the client. Personalised model: the new body + own head.
    No global model: the server has no head (``global/*`` is none).

    Down and up: the body (BatchNorm statistics included). Keeps the head per client."""

    name = "fedrep"
    Options = FedRepOptions
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


class FedBABU(Method):
    """FedBABU (Oh et al., ICLR 2022). During federated training the head stays at its random
    initialisation (never trained, never sent up); clients train and upload the body only. The
    personalised model is the received global model fine-tuned on local data, body and head,
    for ``finetune_fraction`` x the E-epoch step budget at the same learning rate (paper Section
    4: fine-tuning the whole model). The global model is the body with the fixed head.

    Down: the full model; up: the body. Keeps the latest fine-tuned model per client."""

    name = "fedbabu"
    Options = FedBABUOptions
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


class FedLC(Method):
    """FedLC: FedAvg whose local loss calibrates each logit by the client's label counts before
    the softmax (training only; evaluation uses plain logits). Sends and keeps what FedAvg does."""

    name = "fedlc"
    Options = FedLCOptions
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


class GPFL(PartialSharing):
    """GPFL (Zhang et al., ICCV 2023, "GPFL: Simultaneously Learning Global and Personalized Feature
    Information"; TsingZ0/GPFL ``clientgp.py``, ``servergp.py``, ``run_me.sh``; PFLlib's
    ``clientgpfl.py`` is the same arithmetic). The model gets a conditional valve (CoV) between the
    features z and the classifier and global category embeddings (GCE) e_1..e_C
    (``model.conditional_valve``, set by default). Client k's loss:
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
    requires_classifier = "linear"
    has_global_model = False
    keep = "gpfl.own."
    model_defaults = {"conditional_valve": True}
    owns_model_options = frozenset({"conditional_valve"})
    model_requires = {"gce.weight": (True, "model.conditional_valve = true (its defaults set it; a config set it to "
                                           "false)")}

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


__all__ = ["GPFL", "Ditto", "DittoRS", "FedBABU", "FedLC", "FedProto", "FedROD", "FedRep", "balanced_softmax_loss",
           "calibrated_loss", "nearest_prototype_head", "prototype_regularizer"]
