"""FedNTD (Lee et al., NeurIPS 2022), FedLMD (Lu et al., ACM MM 2023), FedVLS (Guo et al., AAAI 2025)
and FedKA (knowledge anchor, 2023) (docs/methods.md, "Keeping what the global model knows").

Both keep the received global model's knowledge of the classes a client lacks: FedNTD distils the
global model's *not-true* class distribution on every batch; FedKA distils the global model's
logits of missing and non-dominant classes on a small anchor set (one sample per such class).
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import ClientData, FedAvgOptions, Method, Source, builtin, model_part, reference_tensor
from fedskew.metrics import class_roles
from fedskew.streams import numpy_rng

# ---------------------------------------------------------------------------------------------
# FedNTD


def not_true_logits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[B, C] -> [B, C - 1]: each row without its true-class entry (order of the rest kept)."""
    C = logits.shape[-1]
    others = torch.arange(C - 1, device=logits.device)
    idx = others + (others[None, :] >= y[:, None]).long()  # skip the true class; no boolean mask (vmap)
    return logits.gather(-1, idx)


def ntd_loss(logits: torch.Tensor, global_logits: torch.Tensor, y: torch.Tensor, tau: float = 1.0,
             tau_squared: bool = False, mean=torch.mean) -> torch.Tensor:
    """KL(softmax(gz~ / T) || softmax(z~ / T)), batch mean, ~ = true class removed, times T^2 when
    ``tau_squared`` (the usual distillation scaling; the official FedNTD code has no T^2)."""
    z, g = not_true_logits(logits, y) / tau, not_true_logits(global_logits, y) / tau
    p_g = F.softmax(g, dim=-1)
    kl = (p_g * (F.log_softmax(g, dim=-1) - F.log_softmax(z, dim=-1))).sum(-1)
    return mean(kl) * (tau ** 2 if tau_squared else 1.0)


class FedNTDOptions(FedAvgOptions):
    search = {'ntd_beta': [0.1, 0.3, 1.0, 3.0], 'ntd_tau': [1.0, 3.0]}  # the bench's search space (fedskew bench)
    ntd_beta: float = Field(1.0, ge=0, description="weight of the not-true distillation term")
    ntd_tau: float = Field(1.0, gt=0, description="distillation temperature T")
    tau_squared: bool = Field(False, description="multiply the KL by T^2 (not in the official code; same at T = 1)")


@builtin
class FedNTD(Method):
    """L = CE(z, y) + beta * NTD(z, frozen received global model's logits), NTD without the T^2
    factor as in the official code (Lee-Gihun/FedNTD; ``tau_squared=true`` adds it). Communication
    as FedAvg."""

    name = "fedntd"
    Options = FedNTDOptions
    source = Source(
        authors="Lee et al.",
        title="Preservation of the Global Knowledge by Not-True Distillation in Federated Learning",
        venue="NeurIPS",
        year=2022,
        arxiv="2106.03097",
        implements="Eq. 4-5 (not-true distillation)",
        code="Lee-Gihun/FedNTD")
    per_sample_loss = True  # Method.padding_exact

    def local_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        _, global_logits = fwd.frozen(model_part(payload), x)
        ntd = ntd_loss(logits, global_logits, y, self.opt.ntd_tau, self.opt.tau_squared, fwd.mean)
        return fwd.cross_entropy(logits, y) + self.opt.ntd_beta * ntd, {"fedntd/ntd": ntd.detach()}


# ---------------------------------------------------------------------------------------------
# FedLMD


def major_classes(counts: torch.Tensor) -> torch.Tensor:
    """[C] counts -> [C] 1.0 where a class holds more samples than the mean over all C classes
    (zeros included), as the official server's ``client_y_lst`` (wnma3mz/FedLMD)."""
    counts = counts.double()
    return (counts > counts.mean()).float()


def lmd_loss(logits: torch.Tensor, global_logits: torch.Tensor, y: torch.Tensor, major: torch.Tensor,
             tau: float = 1.0, mean=torch.mean) -> torch.Tensor:
    """The official ``lmd_criterion``: T^2 KL(p_t || p_s), batch mean, with p_t = softmax(g / T -
    1000 [c major] - 1000 [c = y]) (the global model's logits, the client's major classes and the
    true class masked out) and p_s = softmax(z / T - 1000 [c = y])."""
    gt = F.one_hot(y, logits.shape[-1]).to(logits.dtype)
    t = global_logits / tau - 1000 * major.to(logits.dtype) - 1000 * gt
    log_p_t = F.log_softmax(t, dim=-1)
    kl = (log_p_t.exp() * (log_p_t - F.log_softmax(logits / tau - 1000 * gt, dim=-1))).sum(-1)
    return mean(kl) * tau ** 2


class FedLMDOptions(FedAvgOptions):
    search = {'lmd_beta': [0.3, 1.0, 3.0]}  # the bench's search space (fedskew bench)
    lmd_beta: float = Field(1.0, ge=0, description="weight of the label-masking distillation term; the official "
                                                   "config's 1")
    lmd_tau: float = Field(1.0, gt=0, description="distillation temperature T; the official config's 1")


@builtin
class FedLMD(Method):
    """FedLMD (Lu et al., ACM MM 2023; official code wnma3mz/FedLMD): L = CE(z, y) + beta *
    :func:`lmd_loss`(z, frozen received global model's logits): the global model teaches the
    classes the client has few or none of (its major classes and the sample's true class masked
    from the teacher). Keeps ``lmd.major`` [C] per client; communication as FedAvg."""

    name = "fedlmd"
    Options = FedLMDOptions
    source = Source(
        authors="Lu et al.",
        title="Federated Learning with Label-Masking Distillation",
        venue="ACM MM",
        arxiv="2409.13136", year=2023,
        implements="the label-masking distillation loss (the paper's Section 3)",
        code="wnma3mz/FedLMD")
    per_sample_loss = True  # Method.padding_exact

    def client_init(self, client_id, global_state, info):
        device = reference_tensor(global_state).device
        return {"lmd.major": major_classes(info.class_counts[client_id]).to(device)}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        _, global_logits = fwd.frozen(model_part(payload), x)
        lmd = lmd_loss(logits, global_logits, y, client_state["lmd.major"], self.opt.lmd_tau, fwd.mean)
        return fwd.cross_entropy(logits, y) + self.opt.lmd_beta * lmd, {"fedlmd/lmd": lmd.detach()}


# ---------------------------------------------------------------------------------------------
# FedVLS


def prior_ce(logits: torch.Tensor, y: torch.Tensor, prior: torch.Tensor, ce=F.cross_entropy) -> torch.Tensor:
    """The official ``PriorCELoss`` (krumpguo/FedVLS clientvls.py): CE(z + log(pi + 1e-9), y),
    pi the client's label distribution (logit adjustment)."""
    return ce(logits + torch.log(prior + 1e-9), y)


def logit_suppression(logits: torch.Tensor, y: torch.Tensor, prior: torch.Tensor, scale: float = 0.005) -> torch.Tensor:
    """The official ``new_LADEloss``: for each class c, s_c = logsumexp over the batch of
    (z_nc - log(pi_c + 1e-9) + log(1/C)) [y_n != c] - log N (a sample of class c enters as 0, as
    the code multiplies by the mask), and the loss scale * sum_c pi_c s_c: the adjusted logit of
    every present class pushed down on the samples of other classes."""
    n, c = logits.shape
    spread = (logits - torch.log(prior + 1e-9) + math.log(1.0 / c)) * (y[:, None] != torch.arange(c, device=y.device))
    second = torch.logsumexp(spread, dim=0) - math.log(n)
    return scale * (second * prior).sum()


def vacant_distillation(logits: torch.Tensor, teacher_logits: torch.Tensor, vacant: torch.Tensor,
                        mean=torch.mean) -> torch.Tensor:
    """The official ``VLSloss``: KL(softmax(t_V) || softmax(z_V)), batch mean, over the client's
    vacant classes V only (``vacant`` [C], 1.0 for a class with no local sample); 0 when it has
    none. Written with masks (no data-dependent shapes), so it runs under ``vmap``."""
    off = 1e4 * (1.0 - vacant.to(logits.dtype))  # exp(-1e4) = 0: the present classes leave both softmaxes
    log_s = F.log_softmax(logits - off, dim=-1)
    log_t = F.log_softmax(teacher_logits - off, dim=-1)
    kl = (vacant * log_t.exp() * (log_t - log_s)).sum(-1)
    return mean(kl)


class FedVLSOptions(FedAvgOptions):
    search = {'vls_lambda': [0.03, 0.1, 0.3, 1.0]}  # the bench's search space (fedskew bench)
    vls_lambda: float = Field(0.1, ge=0, description="weight of the vacant-class distillation; 0.1 is the official "
                                                     "README's CIFAR-10 command (its argparse default is 1.0)")
    suppression_scale: float = Field(0.005, ge=0, description="factor of the logit-suppression term; the official "
                                                              "code's fixed 0.005")


@builtin
class FedVLS(Method):
    """FedVLS (Guo et al., AAAI 2025, "Exploring vacant classes in label-skewed FL"; official
    code krumpguo/FedVLS): L = :func:`prior_ce` + :func:`logit_suppression` + lambda *
    :func:`vacant_distillation` against the frozen received global model. Keeps ``vls.prior``
    and ``vls.vacant`` [C] per client; communication as FedAvg. The logit-suppression term sums
    over the batch, so never padded (Method.padding_exact)."""

    name = "fedvls"
    Options = FedVLSOptions
    source = Source(
        authors="Guo et al.",
        title="Exploring Vacant Classes in Label-Skewed Federated Learning",
        venue="AAAI",
        arxiv="2401.02329", year=2025,
        implements="logit suppression and vacant-class distillation (the paper's Section 4)",
        code="krumpguo/FedVLS")

    def client_init(self, client_id, global_state, info):
        device = reference_tensor(global_state).device
        counts = info.class_counts[client_id].double()
        return {"vls.prior": (counts / counts.sum()).float().to(device), "vls.vacant": (counts == 0).float().to(device)}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        _, teacher = fwd.frozen(model_part(payload), x)
        prior = client_state["vls.prior"]
        ce = prior_ce(logits, y, prior, fwd.cross_entropy)
        sup = logit_suppression(logits, y, prior, self.opt.suppression_scale)
        vls = vacant_distillation(logits, teacher, client_state["vls.vacant"], fwd.mean)
        return ce + sup + self.opt.vls_lambda * vls, {
            "fedvls/suppression": sup.detach(),
            "fedvls/vacant_kd": vls.detach(),
        }


# ---------------------------------------------------------------------------------------------
# FedKA


def anchor_indices(roles: torch.Tensor, y_local: np.ndarray, losses: np.ndarray | None, cap: int,
                   strategy: str, rng: np.random.Generator) -> list[tuple[str, int]]:
    """The anchor set of one client for one round: ("public", c) for each missing class c (the
    shared sample), ("local", i) for one local sample of each non-dominant class (random, or the
    largest / smallest loss under the received global model for ``hard`` / ``proficient``); a
    random subset of ``cap`` when more."""
    anchors: list[tuple[str, int]] = []
    for c in range(len(roles)):
        if roles[c] == 0:
            anchors.append(("public", c))
        elif roles[c] == 1:
            pool = np.flatnonzero(y_local == c)
            if strategy == "random":
                anchors.append(("local", int(rng.choice(pool))))
            else:
                order = np.argsort(losses[pool], kind="stable")
                anchors.append(("local", int(pool[order[-1] if strategy == "hard" else order[0]])))
    if len(anchors) > cap:
        keep = np.sort(rng.choice(len(anchors), size=cap, replace=False))
        anchors = [anchors[i] for i in keep]
    return anchors


def knowledge_anchor_loss(local_logits: torch.Tensor, global_logits: torch.Tensor, keep_classes: torch.Tensor,
                          valid: torch.Tensor) -> torch.Tensor:
    """(1/|T|) sum_{t in T} || Phi(f_global(t)) - Phi(f_local(t)) ||_2^2, Phi keeping the logits of
    missing and non-dominant classes (``keep_classes``); ``valid`` masks padding rows of T. Zero
    when T is empty."""
    diff = (global_logits - local_logits) * keep_classes.to(local_logits.dtype)
    per_anchor = diff.pow(2).sum(-1) * valid.to(local_logits.dtype)
    return per_anchor.sum() / valid.to(local_logits.dtype).sum().clamp(min=1)


class FedKAOptions(FedAvgOptions):
    search = {'ka_beta': [0.001, 0.01, 0.1]}  # the bench's search space (fedskew bench)
    ka_beta: float = Field(0.001, ge=0, description="weight of the knowledge-anchor term (paper grid 0.5, 0.1, "
                                                    "0.01, 0.001; 0.1 and 0.01 blow up or lag: docs/methods.md)")
    gamma: float | None = Field(None, gt=0, le=1, description="non-dominant threshold on the class share "
                                                              "(default 1/C)")
    anchor_cap: int = Field(10, ge=1, description="most anchors per client")
    anchor_strategy: Literal["random", "hard", "proficient"] = Field("random", description=
        "which own sample anchors a non-dominant class: random (the paper), or the one with the largest (hard) "
        "/ smallest (proficient) loss under the received global model")


@builtin
class FedKA(Method):
    """L = CE(batch) + beta * knowledge-anchor loss on every mini-batch.

    Before each round's local training the client rebuilds its anchor set (``prepare``): the
    public sample of each missing class (``FederationInfo.public_samples``: one training sample per
    class drawn once from the seed and, as the paper assumes, visible to every client) and one of
    its own samples of each non-dominant class, redrawn every round (stream ``fedka_anchors``),
    capped. The received global model's logits on the anchors are computed once then.

    Keeps per client (rebuilt each round, padded to ``anchor_cap``): anchors, their global logits,
    a validity mask and the kept-class mask. Communication as FedAvg. The anchors pass through the
    model being trained in eval mode (``fwd.evaluate``), the mode of the global logits they are
    compared with: in train mode, the zero padding of the anchor set would enter BatchNorm's batch
    statistics and shift the real anchors' logits (the loss was 0.41 where local = global), and the
    anchors would move the running statistics."""

    name = "fedka"
    Options = FedKAOptions
    source = Source(
        authors="Chen, Zhu, Zheng",
        title="Towards Fast and Stable Federated Learning: Confronting Heterogeneity via Knowledge Anchor",
        venue="arXiv preprint",
        year=2023,
        arxiv="2312.02416",
        implements="Eq. 1 (forgetting degree), Eq. 2 (knowledge anchors) and Eq. 3 (the local objective), Algorithm "
                   "1",
        code="no official code found; the paper's text")
    per_sample_loss = True  # CE per sample; the anchor term does not depend on the batch

    def __init__(self, options=None, info=None):
        super().__init__(options, info)
        if info is not None and info.public_samples is None:
            missing = torch.flatnonzero(info.class_counts.sum(0) == 0).tolist()
            raise ValueError(f"method fedka needs one training sample of every class for its public anchors; "
                             f"the training split has none of classes {missing[:10]}.")

    def class_role_threshold(self, num_classes: int) -> float:
        return self.opt.gamma if self.opt.gamma is not None else 1.0 / num_classes

    def _gamma(self) -> float:
        return self.class_role_threshold(self.info.num_classes)

    def client_init(self, client_id, global_state, info):
        ref = reference_tensor(global_state)
        x_pub, _ = info.public_samples
        cap, C = self.opt.anchor_cap, info.num_classes
        roles = class_roles(info.class_counts[client_id], self._gamma())
        return {"ka.x": torch.zeros(cap, *x_pub.shape[1:], dtype=x_pub.dtype, device=ref.device),
                "ka.global_logits": torch.zeros(cap, C, dtype=ref.dtype, device=ref.device),
                "ka.valid": torch.zeros(cap, dtype=ref.dtype, device=ref.device),
                "ka.keep": (roles < 2).to(device=ref.device, dtype=ref.dtype)}

    def prepare(self, payload, client_state, data: ClientData):
        x_pub, _ = self.info.public_samples
        roles = class_roles(self.info.class_counts[data.client_id], self._gamma())
        global_state = model_part(payload)
        losses = None
        if self.opt.anchor_strategy != "random":
            _, logits = data.frozen(global_state, data.x)
            losses = F.cross_entropy(logits, data.y, reduction="none").cpu().numpy()
        rng = numpy_rng(self.info.seed, "fedka_anchors", data.round_idx, data.client_id)
        anchors = anchor_indices(roles, data.y.cpu().numpy(), losses, self.opt.anchor_cap,
                                 self.opt.anchor_strategy, rng)
        x = torch.zeros_like(client_state["ka.x"])
        valid = torch.zeros_like(client_state["ka.valid"])
        for i, (source, j) in enumerate(anchors):
            x[i] = x_pub[j] if source == "public" else data.x[j]
            valid[i] = 1.0
        _, global_logits = data.frozen(global_state, x)
        return {**client_state, "ka.x": x, "ka.valid": valid, "ka.global_logits": global_logits}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        # anchors first: the batch's train-mode pass below moves BatchNorm's running statistics
        _, anchor_logits = fwd.evaluate(client_state["ka.x"])
        _, logits = fwd(x)
        ce = fwd.cross_entropy(logits, y)
        ka = knowledge_anchor_loss(anchor_logits, client_state["ka.global_logits"], client_state["ka.keep"],
                                   client_state["ka.valid"])
        return ce + self.opt.ka_beta * ka, {"fedka/anchor": ka.detach()}


__all__ = ["FedKA", "FedNTD", "anchor_indices",
           "knowledge_anchor_loss", "not_true_logits", "ntd_loss"]
