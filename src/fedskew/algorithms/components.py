"""The attachable pieces (design.md, "One way to compose"): each is a
:class:`~fedskew.algorithms.compose.Component` that any method takes by configuration
(``method.<component>.<option>=...``) and that the named methods are built from.

=================  =======================  ====================================================
config key         component                from
=================  =======================  ====================================================
``decorrelation``  IntraDecorrelation       FedMR's L_intra (Fan et al., TMLR 2023, Eq. 3)
``prototypes``     PrototypeMargin          FedMR's global prototypes and L_inter (Eq. 4-5)
``rs``             RestrictedSoftmax        FedRS (Li & Zhan, KDD 2021; MAP paper Eq. 8)
``hpm``            InheritedPrivateModel    FedPHP (Li et al., ECML-PKDD 2021; MAP Algorithm 1)
``feddecorr``      Decorrelation            FedDecorr (Shi et al., ICLR 2023, Eq. 4)
``uv``             UniformityVariance       FedUV (Son et al., CVPR 2024): variance, uniformity
``disco``          Discrepancy              FedDisco (Ye et al., ICML 2023): aggregation weights
``sam``            SharpnessAware           FedSAM / FedASAM (Qu et al., ICML 2022; Caldarola et
                                            al., ECCV 2022): SAM / ASAM local steps
=================  =======================  ====================================================

A component's options have one name wherever it is attached: ``method.rs.rs_form`` and
``method=fedrs method.rs_form`` are the same option (``Composed.parts`` passes a named method's
options through by name).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, model_validator

from fedskew.algorithms.base import ClientReport, Forward, Source, State, StrictOptions, reference_tensor, strip_prefix
from fedskew.algorithms.compose import Component
from fedskew.algorithms.tensors import (
    aggregate_prototypes,
    class_feature_means,
    decorrelation_loss,
    disco_weights,
    hpm_momentum,
    inter_class_margin,
    intra_class_loss,
    kd_loss,
    label_discrepancy,
    mmd2,
    rs_scales,
    sharing_clients,
    uniformity_loss,
    variance_loss,
)

# ---------------------------------------------------------------------------------------------
# FedMR's two pieces


class DecorrelationOptions(StrictOptions):
    search = {'mu1': [0.001, 0.01, 0.1]}  # the bench's search space (fedskew bench)
    mu1: float = Field(0.01, ge=0, description="weight of L_intra")
    intra_form: Literal["code", "paper"] = Field("code", description="code: the authors' code's form, with which "
                                                                     "the paper's mu1 values train (default); "
                                                                     "paper: Eq. 3, ||M_c||_F^2")


class PrototypeOptions(StrictOptions):
    mu2: float = Field(1e-4, ge=0, description="weight of L_inter (0: prototypes still computed, no margin)")
    inter_classes: Literal["all", "local"] = Field("all", description=
        "classes j that L_inter keeps a margin against: all: every class with a prototype (the paper's stated "
        "purpose, space for the missing classes); local: only the client's own classes (the paper's Eq. 4)")
    lite_n: int | None = Field(None, ge=1, description="L_inter on n samples of each batch (Lite)")
    share_fraction: float = Field(1.0, gt=0, le=1, description="fraction of clients that upload prototypes")


class IntraDecorrelation(Component):
    """mu1 * L_intra on the features of every mini-batch. No state, nothing sent."""

    prefix = "decorr."
    Options = DecorrelationOptions
    source = Source(
        authors="Fan, Yao, Zhang, Lyu, Zhang, Wang",
        title="Federated Learning under Partially Class-Disjoint Data via Manifold Reshaping (FedMR's L_intra)",
        venue="TMLR",
        year=2023,
        arxiv="2405.18983",
        implements="Eq. 3",
        code="MediaBrain-SJTU/FedMR")

    def loss(self, fwd, params, x, y, payload, client_state):
        z, logits = fwd(x)
        value = intra_class_loss(z, y, logits.shape[-1], self.opt.intra_form)
        return self.opt.mu1 * value, {"fedmr/intra": value.detach()}


class PrototypeMargin(Component):
    """Global class prototypes and mu2 * L_inter.

    Sends down ``proto.g`` [C, d] (NaN rows: no prototype yet): C*d floats. A sharing client
    sends up ``proto.mean`` [C, d] and ``proto.count`` [C]: C*d + C floats. Keeps on the server
    ``proto.g``; on the client ``proto.classes`` (its class counts, for |C_k| and ``local``) and
    ``proto.share`` (whether it may upload).
    """

    prefix = "proto."
    Options = PrototypeOptions
    source = Source(
        authors="Fan, Yao, Zhang, Lyu, Zhang, Wang",
        title="Federated Learning under Partially Class-Disjoint Data via Manifold Reshaping (FedMR's L_inter)",
        venue="TMLR",
        year=2023,
        arxiv="2405.18983",
        implements="Eq. 4-5",
        code="MediaBrain-SJTU/FedMR")

    def server_init(self, global_state, info):
        ref = reference_tensor(global_state)
        return {"proto.g": torch.full((info.num_classes, info.feature_dim), float("nan"),
                                      dtype=ref.dtype, device=ref.device)}

    def client_init(self, client_id, global_state, info):
        share = client_id in sharing_clients(info.seed, info.num_clients, self.opt.share_fraction)
        device = reference_tensor(global_state).device
        return {"proto.classes": info.class_counts[client_id].to(device=device, dtype=torch.float32),
                "proto.share": torch.tensor(float(share), device=device)}

    def broadcast(self, server_state):
        return {"proto.g": server_state["proto.g"]}

    def loss(self, fwd, params, x, y, payload, client_state):
        if self.opt.mu2 == 0:
            return None, {}
        z, _ = fwd(x)
        if self.opt.lite_n is not None:
            # Batches are drawn from a fresh permutation every epoch, so the first n samples of
            # a batch are a uniformly random subset of it (and the same in every executor).
            z, y = z[:self.opt.lite_n], y[:self.opt.lite_n]
        value = inter_class_margin(z, y, payload["proto.g"], client_state["proto.classes"], self.opt.inter_classes)
        return self.opt.mu2 * value, {"fedmr/inter": value.detach()}

    def after_training(self, trained, payload, client_state, report: ClientReport):
        """Eval-mode features of the whole local training set -> class means and counts."""
        if not bool(client_state["proto.share"]):
            return {}, client_state
        z, y = report.local_features(trained)
        means, counts = class_feature_means(z, y, payload["proto.g"].shape[0])
        return {"proto.mean": means, "proto.count": counts}, client_state

    def aggregate(self, server_state, uploads, reports):
        sent = [u for u in uploads if "proto.mean" in u]
        g = aggregate_prototypes(server_state["proto.g"], [u["proto.mean"] for u in sent],
                                 [u["proto.count"] for u in sent])
        return {"proto.g": g}


# ---------------------------------------------------------------------------------------------
# Restricted softmax (FedRS)

# MAP paper Sections 5.2.2 and 5.2.5: alpha = 0.9 is its stated and preferred value (digits, 100
# rounds: FedRS 92.9 at 0.9 vs 86.9 at 0.5, FedAvg 94.1).
ALPHA = 0.9
# The MAP family's classifier has no bias (a bias on missing classes would escape the restriction);
# the authors' networks (lxcnju/MAP networks/basic_classify_nets.py) are all built with bias=False.
BIAS_FREE = {"classifier_bias": False}


class _RestrictedForward(Forward):
    """The training forward with logits s * (W z): the restriction acts on training only."""

    def __init__(self, fwd: Forward, scales: torch.Tensor):
        self.wrapping(fwd)
        self._scales = scales

    def __call__(self, x):
        z, logits = self._train_fn(x)
        return z, logits * self._scales


class RSOptions(StrictOptions):
    search = {'alpha': [0.5, 0.9]}  # the bench's search space (fedskew bench)
    renamed = {"form": "rs_form"}
    alpha: float = Field(ALPHA, ge=0, le=1, description="scale of missing classes' logits (1: plain softmax)")
    rs_form: Literal["hard", "soft"] = Field("hard", description="hard: s_c = alpha for a class with no local "
                                                                 "sample (MAP paper); soft: alpha + (1 - alpha) "
                                                                 "n_c / max n (FedRS code)")


class RestrictedSoftmax(Component):
    """Restricted softmax on the uploaded model's training: logit_c = s_c * (w_c . z) (paper Eq. 8),
    so the gradient reaching a missing class's classifier row is alpha times the plain one at the
    same restricted probabilities (paper Eq. 9). Evaluation uses plain logits. Use a bias-free
    classifier (``model.classifier_bias=false``) as the papers do; with a bias the scale applies to
    the whole logit, bias included, so the restriction still holds.

    Keeps ``rs.scale`` [C] per client; sends nothing."""

    prefix = "rs."
    Options = RSOptions
    source = Source(
        authors="Li, Zhan",
        title="FedRS: Federated Learning with Restricted Softmax for Label Distribution Non-IID Data",
        venue="KDD",
        year=2021,
        implements="MAP paper Eq. 8",
        code="lxcnju/FedRepo")
    per_sample_loss = True  # logits scaled per sample (Component.padding_exact)

    def client_init(self, client_id, global_state, info):
        device = reference_tensor(global_state).device
        return {"rs.scale": rs_scales(info.class_counts[client_id], self.opt.alpha, self.opt.rs_form).to(device)}

    def wrap_forward(self, fwd, client_state):
        return _RestrictedForward(fwd, client_state["rs.scale"])


# ---------------------------------------------------------------------------------------------
# Inherited private model (FedPHP)


class HPMOptions(StrictOptions):
    search = {'kt_lambda': [0.001, 0.01, 0.1]}  # the bench's search space (fedskew bench)
    kt: Literal["kd", "mmd"] = Field("kd", description=
        "knowledge-transfer term from the inherited private model: kd: distillation of its logits; mmd: MMD^2 "
        "between its features and the trained model's")
    kt_lambda: float = Field(0.01, ge=0, le=1, description="L = (1 - lambda) CE + lambda L_kt")
    temperature: float = Field(4.0, gt=0, description="KD temperature T")
    kd_form: Literal["paper", "code"] = Field("paper", description=
        "paper: KL(softmax(g_p / T) || softmax(g / T)) T^2; code: FedPHP reference code's cross-entropy from "
        "softmax(g_p / T) to softmax(g), no T on the student, no T^2")
    mu_max: float = Field(0.9, ge=0, le=1, description="cap of the HPM momentum")
    schedule: Literal["code", "paper", "fedphp"] = Field(
        "code", description="code: all E epochs uploaded, then max(0.1 S, 5) steps at 0.2 lr (MAP authors' code, "
                            "default); paper: E/2 + E/2 (MAP Algorithm 1); fedphp: one stage with the KT term")


class InheritedPrivateModel(Component):
    """Each client's inherited private model (HPM) psi_p, its personalised model.

    schedule ``code`` (MAP authors' code, default): the uploaded model trains all E epochs, then a
    personalisation stage of max(ceil(0.1 * steps), 5) steps at 0.2 x lr from a copy of it, with
    (1 - lambda) CE + lambda L_kt, and the HPM's BatchNorm statistics are recomputed over one pass
    of local data after its update. ``paper`` (MAP Algorithm 1): the uploaded model trains on the
    first half of the E-epoch step budget (rounded up), the personalisation stage on the rest at
    the same lr. ``fedphp`` (FedPHP): no second stage; the uploaded model itself trains all E
    epochs on (1 - lambda) CE + lambda L_kt, and updates the HPM.

    Keeps ``hpm.model.*`` (a full model state, BN buffers included), ``hpm.visits`` and
    ``hpm.expected`` per client: |theta| + 2 floats. Sends nothing beyond the base method."""

    prefix = "hpm."
    Options = HPMOptions
    source = Source(
        authors="Li, Zhan, Shao, Li, Song",
        title="FedPHP: Federated Personalization with Inherited Private Models",
        venue="ECML PKDD",
        year=2021,
        implements="MAP paper Eq. 9-10",
        code="lxcnju/FedRepo")
    personalizes = True
    per_sample_loss = True  # with kt=kd; MMD compares batch feature distributions

    def padding_exact(self, stage):
        return self.opt.kt == "kd" and super().padding_exact(stage)

    def client_init(self, client_id, global_state, info):
        ref = reference_tensor(global_state)
        state = {"hpm.model." + k: v.clone() for k, v in global_state.items()}
        state["hpm.visits"] = torch.zeros((), dtype=ref.dtype, device=ref.device)
        state["hpm.expected"] = torch.tensor(info.clients_per_round / info.num_clients * info.rounds,
                                             dtype=ref.dtype, device=ref.device)
        return state

    def split_steps(self, total_steps, lr):
        if self.opt.schedule == "paper":
            first = math.ceil(total_steps / 2)
            return first, total_steps - first, lr
        if self.opt.schedule == "fedphp":
            return total_steps, 0, lr
        return total_steps, max(math.ceil(0.1 * total_steps), 5), 0.2 * lr

    def _transfer(self, fwd, x, client_state):
        """L_kt from the HPM (frozen teacher, eval mode) to the model being trained, and the logits."""
        z, logits = fwd(x)
        z_p, logits_p = fwd.frozen(_hpm(client_state), x)
        kt = (kd_loss(logits, logits_p, self.opt.temperature, self.opt.kd_form, fwd.mean) if self.opt.kt == "kd"
              else mmd2(z, z_p))
        return kt, logits

    def loss(self, fwd, params, x, y, payload, client_state):
        """``fedphp``: lambda (L_kt - CE) added to the base loss, so that with FedAvg's CE the uploaded
        model trains on (1 - lambda) CE + lambda L_kt exactly (FedPHP Eq. 4)."""
        if self.opt.schedule != "fedphp":
            return None, {}
        kt, logits = self._transfer(fwd, x, client_state)
        lam = self.opt.kt_lambda
        return lam * (kt - fwd.cross_entropy(logits, y)), {f"hpm/{self.opt.kt}": kt.detach()}

    def after_training(self, trained, payload, client_state, report):
        if self.opt.schedule != "fedphp":
            return {}, client_state
        return {}, self._update(trained, client_state, report)

    def personal_start(self, trained, payload, client_state):
        return trained

    def personal_loss(self, fwd, params, x, y, payload, client_state):
        kt, logits = self._transfer(fwd, x, client_state)
        lam = self.opt.kt_lambda
        return (1 - lam) * fwd.cross_entropy(logits, y) + lam * kt, {f"hpm/{self.opt.kt}": kt.detach()}

    def after_personal(self, personal, payload, client_state, report: ClientReport):
        return self._update(personal, client_state, report)

    def _update(self, personal, client_state, report: ClientReport):
        """psi_p <- mu_k psi_p + (1 - mu_k) psi_personalised (FedPHP Eq. 3)."""
        # floor(q T) is a per-run constant; float() is safe here (outside vmap: runs per client).
        mu = hpm_momentum(client_state["hpm.visits"], float(client_state["hpm.expected"]), self.opt.mu_max)
        old = _hpm(client_state)
        new = {k: (mu * old[k] + (1 - mu) * personal[k]).to(old[k].dtype) for k in old}
        if self.opt.schedule == "code" and report.recalibrate_bn is not None:
            new = report.recalibrate_bn(new)
        out = {"hpm.model." + k: v for k, v in new.items()}
        out["hpm.visits"] = client_state["hpm.visits"] + 1
        out["hpm.expected"] = client_state["hpm.expected"]
        return out

    def personal_state(self, trained, client_state):
        return _hpm(client_state)


def _hpm(client_state: State) -> State:
    return strip_prefix(client_state, "hpm.model.")


# ---------------------------------------------------------------------------------------------
# FedDecorr


class FedDecorrOptions(StrictOptions):
    search = {'beta': [0.01, 0.05, 0.1]}  # the bench's search space (fedskew bench)
    beta: float = Field(0.1, ge=0, description="weight of the decorrelation term (official default 0.1)")
    form: Literal["code", "paper"] = Field("code", description="official code's scale (default) or Eq. 4's")
    eps: float = Field(1e-8, gt=0, description="standardisation (z - mean) / sqrt(var + eps); 1e-8 is the official "
                                               "FedDecorrLoss constant")


class Decorrelation(Component):
    """beta * FedDecorr's regulariser on the features of every mini-batch (whole batch, all
    classes together; FedMR's ``decorrelation`` is the per-class version). No state, nothing sent.
    Reads batch statistics, so never padded (Method.padding_exact)."""

    prefix = "feddecorr."
    Options = FedDecorrOptions
    source = Source(
        authors="Shi et al.",
        title="Towards Understanding and Mitigating Dimensional Collapse in Heterogeneous Federated Learning",
        venue="ICLR",
        year=2023,
        arxiv="2210.00226",
        implements="Eq. 4",
        code="bytedance/FedDecorr")

    def loss(self, fwd, params, x, y, payload, client_state):
        z, _ = fwd(x)
        value = decorrelation_loss(z, self.opt.form, self.opt.eps)
        return self.opt.beta * value, {"feddecorr/loss": value.detach()}


# ---------------------------------------------------------------------------------------------
# FedUV


class UVOptions(StrictOptions):
    search = {'unif_coeff': [0.1, 0.5, 1.0]}  # the bench's search space (fedskew bench)
    std_coeff: float = Field(2.5, ge=0, description="weight of the classifier-variance term; the official default 2.5")
    unif_coeff: float = Field(0.5, ge=0, description="weight of the hyperspherical-uniformity term; the official "
                                                     "default 0.5")


class UniformityVariance(Component):
    """FedUV's two local regularisers on every mini-batch (official ``UVReg``):
    std_coeff * :func:`variance_loss` of the logits + unif_coeff * :func:`uniformity_loss` of the
    features z the classifier reads (the official networks' ``pro1``, the last hidden layer). No
    state, nothing sent. Reads batch statistics, so never padded (Method.padding_exact)."""

    prefix = "uv."
    Options = UVOptions
    source = Source(
        authors="Son et al.",
        title="FedUV: Uniformity and Variance for Heterogeneous Federated Learning",
        venue="CVPR",
        arxiv="2402.18372", year=2024,
        implements="the official UVReg's two regularisers",
        code="sonhamin/FedUV")

    def loss(self, fwd, params, x, y, payload, client_state):
        z, logits = fwd(x)
        std, unif = variance_loss(logits), uniformity_loss(z)
        return self.opt.std_coeff * std + self.opt.unif_coeff * unif, {"feduv/std": std.detach(),
                                                                       "feduv/unif": unif.detach()}


# ---------------------------------------------------------------------------------------------
# FedDisco


class DiscoOptions(StrictOptions):
    search = {'disco_a': [0.1, 0.5, 1.0]}  # the bench's search space (fedskew bench)
    disco_a: float = Field(0.5, ge=0, description="a in ReLU(p_k - a d_k + b); the official default 0.5")
    disco_b: float = Field(0.1, description="b in ReLU(p_k - a d_k + b); the official default 0.1")
    disco_metric: Literal["kl", "l1", "l2", "cosine"] = Field(
        "kl", description="discrepancy d_k between a client's label distribution and the uniform one; kl (divided by "
                          "its sum over the round's clients) is the official default")


class Discrepancy(Component):
    """FedDisco's discrepancy-aware aggregation weights on any method that aggregates with FedAvg's
    weights p_k: p_k <- ReLU(p_k - a d_k + b) / sum, d_k the discrepancy of client k's label
    distribution from the uniform one (:func:`label_discrepancy`, :func:`disco_weights`). The
    server keeps ``disco.counts`` [K, C], the clients' label counts, which each client tells it once
    at the start (the official code reads them from the partition too); nothing is sent per round."""

    prefix = "disco."
    Options = DiscoOptions
    source = Source(
        authors="Ye et al.",
        title="FedDisco: Federated Learning with Discrepancy-Aware Collaboration",
        venue="ICML",
        arxiv="2305.19229", year=2023,
        implements="Eq. 3-4",
        code="MediaBrain-SJTU/FedDisco")

    def server_init(self, global_state, info):
        return {"disco.counts": info.class_counts.double().clone()}

    def reweight(self, server_state, weights, reports):
        counts = server_state["disco.counts"].cpu()[[r.client_id for r in reports]]
        d = label_discrepancy(counts, self.opt.disco_metric)
        return disco_weights(weights, d, self.opt.disco_a, self.opt.disco_b)


# ---------------------------------------------------------------------------------------------
# Sharpness-aware local steps (FedSAM, FedASAM)


class SAMOptions(StrictOptions):
    search = {'rho': [0.02, 0.05, 0.1]}  # the bench's search space (fedskew bench)
    rho: float = Field(0.1, gt=0, description="radius of the ascent step; FedSAM's official CIFAR-10 script uses 0.1")
    adaptive: bool = Field(False, description="ASAM's scale-invariant radius T = |w| + eta (FedASAM) instead of SAM's")
    eta: float = Field(0.2, ge=0, description="ASAM's eta in T = |w| + eta (adaptive only); FedASAM's script: 0.2")

    @model_validator(mode="after")
    def _eta_needs_adaptive(self):
        if "eta" in self.model_fields_set and not self.adaptive:
            raise ValueError("eta applies only with adaptive = true (ASAM); SAM has no eta")
        return self


class SharpnessAware(Component):
    """Every local step of the uploaded model's training is a SAM (or ASAM) step: the gradient
    g at w gives the ascent eps (:func:`~fedskew.algorithms.tensors.sam_perturbation`), the loss is
    differentiated again at w + eps (a second forward in train mode, as the official
    ``SAMClient.run_epoch``, BatchNorm statistics included), and SGD steps from w with that second
    gradient. Both executors take the two passes (the vectorised one inside its vmapped step); the
    personalisation stage takes plain steps. No state, nothing sent."""

    prefix = "sam."
    Options = SAMOptions
    source = Source(
        authors="Caldarola, Caputo, Ciccone; Qu et al.",
        title="Improving Generalization in Federated Learning by Seeking Flat Minima (ECCV 2022); Generalized "
              "Federated Learning via Sharpness Aware Minimization (ICML 2022)",
        venue="ECCV / ICML",
        year=2022,
        arxiv="2203.11834, 2206.02618",
        implements="SAM and ASAM local steps",
        code="debcaldarola/fedsam")
    sharpness_aware = True


COMPONENTS: dict[str, type[Component]] = {"decorrelation": IntraDecorrelation, "prototypes": PrototypeMargin,
                                          "rs": RestrictedSoftmax, "hpm": InheritedPrivateModel,
                                          "feddecorr": Decorrelation, "uv": UniformityVariance, "disco": Discrepancy,
                                          "sam": SharpnessAware}
