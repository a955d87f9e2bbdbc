"""The MAP family (methods.md section 2): restricted softmax (FedRS, Li & Zhan, KDD 2021), the
inherited private model (FedPHP, Li et al., ECML-PKDD 2021), and MAP = both (Li et al., 2023).

Both pieces are components, so they combine with any base method: ``method=scaffold
method.rs.alpha=0.5 method.hpm.kt=kd`` is the paper's ScaMAP, ``method=scaffold
method.rs.alpha=0.5`` its ScaRS.

MAP round on a selected client (default: the authors' code schedule, lxcnju/MAP
``algorithms/fedap.py``): all E local epochs train the received global model with restricted
softmax; that model is uploaded. A short second stage (max(0.1 S, 5) steps at 0.2 x lr) continues
from a copy of it with plain softmax and knowledge transfer from the client's inherited private
model (HPM); the result updates the HPM with momentum, and the HPM is the client's personalised
model. The paper's Algorithm 1 (E/2 epochs each) is ``schedule=paper``.

FedPHP (its own paper and the MAP authors' ``algorithms/fedphp.py``) is one stage: all E epochs of
(1 - lambda) CE + lambda KT from the HPM, that model is uploaded and updates the HPM
(``schedule=fedphp``, FedPHP's default).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from fedskew.methods.base import ClientReport, FedAvgOptions, Forward, State, reference_tensor, strip_prefix
from fedskew.methods.compose import Component, FedAvgWith
from fedskew.methods.representation import mmd2


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------------------------
# Restricted softmax


def rs_scales(class_counts: torch.Tensor, alpha: float, form: str = "hard") -> torch.Tensor:
    """Per-class logit scales s_c of one client (FedRS; MAP paper Eq. 8).

    hard (MAP paper): s_c = 1 for a class with at least one local training sample, alpha otherwise.
    soft (FedRS reference code): s_c = alpha + (1 - alpha) * n_c / max_c' n_c'.
    (The MAP reference code compares the class *fraction* with 1, which gives alpha to every
    class; not reproduced.)"""
    counts = class_counts.to(torch.float32)
    if form == "hard":
        return torch.where(counts >= 1, torch.ones_like(counts), torch.full_like(counts, alpha))
    return alpha + (1 - alpha) * counts / counts.max().clamp(min=1)


class _RestrictedForward(Forward):
    """The training forward with logits s * (W z): the restriction acts on training only."""

    def __init__(self, fwd: Forward, scales: torch.Tensor):
        self.wrapping(fwd)
        self._scales = scales

    def __call__(self, x):
        z, logits = self._train_fn(x)
        return z, logits * self._scales


# MAP paper Sections 5.2.2 and 5.2.5: alpha = 0.9 is its stated and preferred value (digits, 100
# rounds: FedRS 92.9 at 0.9 vs 86.9 at 0.5, FedAvg 94.1).
ALPHA = 0.9
# The MAP family's classifier has no bias (a bias on missing classes would escape the restriction);
# the authors' networks (lxcnju/MAP networks/basic_classify_nets.py) are all built with bias=False.
BIAS_FREE = {"classifier_bias": False}


class RSOptions(_Strict):
    alpha: float = Field(ALPHA, ge=0, le=1, description="scale of missing classes' logits (1: plain softmax)")
    form: Literal["hard", "soft"] = "hard"


class RestrictedSoftmax(Component):
    """Restricted softmax on the uploaded model's training: logit_c = s_c * (w_c . z) (paper Eq. 8),
    so the gradient reaching a missing class's classifier row is alpha times the plain one at the
    same restricted probabilities (paper Eq. 9). Evaluation uses plain logits. Use a bias-free
    classifier (``model.classifier_bias=false``) as the papers do; with a bias the scale applies to
    the whole logit, bias included, so the restriction still holds.

    Keeps ``rs.scale`` [C] per client; sends nothing."""

    prefix = "rs."
    Options = RSOptions
    per_sample_loss = True  # logits scaled per sample (Component.padding_exact)

    def client_init(self, client_id, global_state, info):
        device = reference_tensor(global_state).device
        return {"rs.scale": rs_scales(info.class_counts[client_id], self.opt.alpha, self.opt.form).to(device)}

    def wrap_forward(self, fwd, client_state):
        return _RestrictedForward(fwd, client_state["rs.scale"])


# ---------------------------------------------------------------------------------------------
# Inherited private model


def hpm_momentum(visits: torch.Tensor, expected_visits: float, mu_max: float = 0.9) -> torch.Tensor:
    """FedPHP's momentum mu_k = clip(mu_max * Q_k / max(floor(q T), 1), 0, mu_max), Q_k the number
    of earlier visits of the client, q T its expected number of visits in the run. A first visit
    gives 0: the HPM becomes the newly personalised model."""
    return torch.clamp(mu_max * visits / max(math.floor(expected_visits), 1), 0.0, mu_max)


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 4.0,
            form: str = "paper", mean=torch.mean) -> torch.Tensor:
    """Knowledge distillation from the HPM (teacher) to the model being trained.

    paper: KL(softmax(g_p / T) || softmax(g / T)) * T^2, mean over the batch.
    code (FedPHP reference): cross-entropy from softmax(g_p / T) to softmax(g), no T on the student,
    no T^2."""
    p_teacher = F.softmax(teacher_logits / temperature, dim=-1)
    if form == "paper":
        log_student = F.log_softmax(student_logits / temperature, dim=-1)
        kl = (p_teacher * (torch.log(p_teacher.clamp(min=1e-12)) - log_student)).sum(-1)
        return mean(kl) * temperature ** 2
    return mean(-(p_teacher * F.log_softmax(student_logits, dim=-1)).sum(-1))


class HPMOptions(_Strict):
    kt: Literal["kd", "mmd"] = "kd"
    kt_lambda: float = Field(0.01, ge=0, le=1, description="L = (1 - lambda) CE + lambda L_kt")
    temperature: float = Field(4.0, gt=0, description="KD temperature T")
    kd_form: Literal["paper", "code"] = "paper"
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
# The methods


class FedRSOptions(FedAvgOptions):
    alpha: float = Field(ALPHA, ge=0, le=1, description="scale of missing classes' logits")
    rs_form: Literal["hard", "soft"] = "hard"


class FedPHPOptions(FedAvgOptions, HPMOptions):
    schedule: Literal["code", "paper", "fedphp"] = Field(
        "fedphp", description="fedphp: one stage with the KT term, uploaded (FedPHP, default); code/paper: MAP's "
                              "two-stage schedules without restricted softmax")


class MAPOptions(FedAvgOptions, HPMOptions):
    alpha: float = Field(ALPHA, ge=0, le=1, description="scale of missing classes' logits")
    rs_form: Literal["hard", "soft"] = "hard"


def _hpm_options(opt) -> HPMOptions:
    return HPMOptions(**{k: getattr(opt, k) for k in HPMOptions.model_fields})


class FedRS(FedAvgWith):
    """FedAvg + restricted softmax."""

    name = "fedrs"
    Options = FedRSOptions

    model_defaults = BIAS_FREE

    def parts(self, opt):
        return [RestrictedSoftmax(RSOptions(alpha=opt.alpha, form=opt.rs_form))]


class FedPHP(FedAvgWith):
    """FedPHP: all E epochs of (1 - lambda) CE + lambda KT from the HPM, uploaded; the HPM then
    takes it with momentum and is the personalised model."""

    name = "fedphp"
    Options = FedPHPOptions

    model_defaults = BIAS_FREE

    def parts(self, opt):
        return [InheritedPrivateModel(_hpm_options(opt))]


class MAP(FedAvgWith):
    """FedAvg + restricted softmax on the uploaded model + the HPM personalisation stage
    (authors' code schedule by default)."""

    name = "map"
    Options = MAPOptions

    model_defaults = BIAS_FREE

    def parts(self, opt):
        return [RestrictedSoftmax(RSOptions(alpha=opt.alpha, form=opt.rs_form)),
                InheritedPrivateModel(_hpm_options(opt))]


COMPONENTS: dict[str, type[Component]] = {"rs": RestrictedSoftmax, "hpm": InheritedPrivateModel}

__all__ = ["COMPONENTS", "FedPHP", "FedRS", "InheritedPrivateModel", "MAP", "RestrictedSoftmax",
           "hpm_momentum", "kd_loss", "rs_scales"]
