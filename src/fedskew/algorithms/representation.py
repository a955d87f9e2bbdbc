"""Representation-level baselines: MOON, FedMMD, FedProc, FedDecorr and FedUV.

MOON and FedMMD regularise the features z of the model being trained against other models' features on the
same batch, through ``fwd.frozen`` (eval mode, no gradient), so they run in every executor.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin, model_part
from fedskew.algorithms.components import (
    Decorrelation,
    FedDecorrOptions,
    PrototypeMargin,
    PrototypeOptions,
    UniformityVariance,
    UVOptions,
)
from fedskew.algorithms.compose import Composed, options_of
from fedskew.algorithms.tensors import mmd2


def moon_contrastive(z: torch.Tensor, z_global: torch.Tensor, z_prev: torch.Tensor, temperature: float,
                     mean=torch.mean) -> torch.Tensor:
    """MOON's model-contrastive loss (Li et al., 2021, Eq. 3), batch mean:
    -log( exp(cos(z, z_glob)/tau) / (exp(cos(z, z_glob)/tau) + exp(cos(z, z_prev)/tau)) )."""
    sims = torch.stack([F.cosine_similarity(z, z_global, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)], -1)
    return mean(-F.log_softmax(sims / temperature, dim=-1)[..., 0])


class MoonOptions(FedAvgOptions):
    search = {'mu': [0.1, 1.0, 5.0], 'temperature': [0.5, 1.0]}  # the bench's search space (fedskew bench)
    # mu = 1 (the MOON paper's CIFAR-100 / Tiny-ImageNet value): at its CIFAR-10 value 5 MOON ended
    # near chance on 1 of 3 seeds of Fashion-MNIST P10C2 (27.20 mean of last 5 vs 39.59 at mu = 1,
    # seed 0; docs/benchmarks.md "Method health")
    mu: float = Field(1.0, ge=0, description="weight of the contrastive term (paper: 5 CIFAR-10, 1 CIFAR-100)")
    temperature: float = Field(0.5, gt=0, description="tau of the model-contrastive loss")


@builtin
class Moon(Method):
    """MOON: CE + mu * model-contrastive loss between the features of the local model, the frozen
    received global model (positive) and the client's previous local model (negative). In a
    client's first round there is no previous model and the term is zero. Use
    ``model.projection_dim=256`` for the paper's projection head.

    Down |theta|, up |theta|; the client keeps its previous local model (|theta|)."""

    name = "moon"
    Options = MoonOptions
    source = Source(
        authors="Li, He, Song",
        title="Model-Contrastive Federated Learning",
        venue="CVPR",
        year=2021,
        arxiv="2103.16257",
        implements="Eq. 2-3 (the model-contrastive loss) and Algorithm 1",
        code="QinbinLi/MOON")
    per_sample_loss = True  # Method.padding_exact

    def client_init(self, client_id, global_state, info):
        state = {"prev." + k: torch.zeros_like(v) for k, v in global_state.items()}
        state["has_prev"] = torch.zeros((), device=next(iter(global_state.values())).device)
        return state

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, logits = fwd(x)
        ce = fwd.cross_entropy(logits, y)
        z_glob, _ = fwd.frozen(model_part(payload), x)
        z_prev, _ = fwd.frozen({k[5:]: v for k, v in client_state.items() if k.startswith("prev.")}, x)
        con = moon_contrastive(z, z_glob, z_prev, self.opt.temperature, fwd.mean)
        return ce + self.opt.mu * client_state["has_prev"] * con, {"moon/contrastive": con.detach()}

    def after_training(self, trained, payload, client_state, report):
        state = {"prev." + k: v for k, v in trained.items()}
        state["has_prev"] = torch.ones_like(client_state["has_prev"])
        upload, _ = super().after_training(trained, payload, client_state, report)
        return upload, state


class FedMMDOptions(FedAvgOptions):
    search = {'lam': [0.001, 0.01, 0.1]}  # the bench's search space (fedskew bench)
    # 0.01: at 0.1 FedMMD ended near chance on 2 of 3 seeds of Fashion-MNIST P10C2 (21.65 vs 43.99
    # at 0.01, seed 0; docs/benchmarks.md "Method health")
    lam: float = Field(0.01, ge=0, description="weight of the MMD term")


@builtin
class FedMMD(Method):
    """FedMMD (Yao et al., 2018): CE + lambda * MMD^2 between the batch features of the local
    model and of the frozen received global model. Sends and keeps what FedAvg does."""

    name = "fedmmd"
    Options = FedMMDOptions
    source = Source(
        authors="Yao et al.",
        title="Two-Stream Federated Learning: Reduce the Communication Costs",
        venue="IEEE VCIP",
        year=2018,
        implements="the MMD-regularised local objective (Section 3)",
        code="no official code; the paper's MMD objective")

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, logits = fwd(x)
        z_glob, _ = fwd.frozen(model_part(payload), x)
        value = mmd2(z, z_glob)
        return F.cross_entropy(logits, y) + self.opt.lam * value, {"fedmmd/mmd": value.detach()}


def proto_contrastive(z: torch.Tensor, y: torch.Tensor, prototypes: torch.Tensor, temperature: float):
    """FedProc's prototype-contrastive loss per sample: -log softmax_c(cos(z, g_c) / tau)[y] over
    the classes with a prototype (NaN rows: none yet). Returns (per-sample loss, usable mask): a
    sample whose own class has no prototype is not usable."""
    valid = ~torch.isnan(prototypes[:, 0])
    protos = F.normalize(torch.nan_to_num(prototypes, nan=0.0), dim=1)
    logits = F.normalize(z, dim=1) @ protos.T / temperature
    logits = logits.masked_fill(~valid[None, :], float("-inf"))
    usable = valid[y]
    logp = torch.log_softmax(torch.where(valid.any(), logits, torch.zeros_like(logits)), dim=1)
    per_sample = -logp.gather(1, y[:, None]).squeeze(1)
    return torch.where(usable, per_sample, torch.zeros_like(per_sample)), usable


class FedProcOptions(FedAvgOptions):
    search = {'temperature': [0.1, 0.5, 1.0]}  # the bench's search space (fedskew bench)
    temperature: float = Field(0.5, gt=0, description="tau of the prototype-contrastive loss L_pc")


class FedProcBase(Method):
    """The loss side of FedProc (Mu et al., 2021): a_t * L_pc + (1 - a_t) * CE per sample, with
    a_t = 1 - t / T sent down each round (1 float). A sample whose class has no global prototype
    yet (round 0, or a class no client has reported) uses CE alone, so the first round trains."""

    name = "fedproc"
    Options = FedProcOptions
    per_sample_loss = True  # Method.padding_exact

    def server_init(self, global_state, info):
        return {"fedproc.t": torch.zeros((), device=next(iter(global_state.values())).device)}

    def broadcast(self, global_state, server_state):
        a = 1.0 - server_state["fedproc.t"] / self.info.rounds
        return {**super().broadcast(global_state, server_state), "fedproc.a": a}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, logits = fwd(x)
        ce = F.cross_entropy(logits, y, reduction="none")
        pc, usable = proto_contrastive(z, y, payload["proto.g"], self.opt.temperature)
        a = payload["fedproc.a"] * usable.to(z.dtype)
        return fwd.mean((1 - a) * ce + a * pc), {"fedproc/contrastive": fwd.mean(pc).detach()}

    def aggregate(self, server_state, global_state, uploads, reports):
        new, _ = super().aggregate(server_state, global_state, uploads, reports)
        return new, {"fedproc.t": server_state["fedproc.t"] + 1}


@builtin
class FedProc(Composed):
    """FedProc = its loss + FedMR's prototype machinery (class means up, count-weighted global
    prototypes down) with no margin term. Down |theta| + C*d + 1, up |theta| + C*d + C."""

    name = "fedproc"
    Options = FedProcOptions
    source = Source(
        authors="Mu et al.",
        title="FedProc: Prototypical Contrastive Federated Learning on Non-IID Data",
        venue="Future Generation Computer Systems",
        year=2023,
        arxiv="2109.12273",
        implements="Eq. 5 (prototypical contrastive loss) and Eq. 6 (its weight schedule)",
        code="no official code; the paper's Eq. 5-6")
    base_method = FedProcBase

    def parts(self, opt):
        return [PrototypeMargin(PrototypeOptions(mu2=0.0))]


# ---------------------------------------------------------------------------------------------
# FedDecorr


class FedDecorrMethodOptions(FedDecorrOptions, FedAvgOptions):
    pass


@builtin
class FedDecorr(Composed):
    """FedDecorr (Shi et al., ICLR 2023): FedAvg + beta * the decorrelation regulariser; any other
    method takes it as ``method.feddecorr.beta=0.1``. Sends and keeps what FedAvg does."""

    name = "feddecorr"
    Options = FedDecorrMethodOptions
    source = dataclasses.replace(Decorrelation.source, implements="Eq. 4 (the decorrelation regulariser)")

    def parts(self, opt):
        return [Decorrelation(options_of(FedDecorrOptions, opt))]


# ---------------------------------------------------------------------------------------------
# FedUV


class FedUVOptions(UVOptions, FedAvgOptions):
    pass


@builtin
class FedUV(Composed):
    """FedUV (Son et al., CVPR 2024; sonhamin/FedUV): FedAvg + the classifier-variance and
    hyperspherical-uniformity regularisers (:class:`~fedskew.algorithms.components.UniformityVariance`);
    any other method takes them as ``method.uv.std_coeff=2.5``. Sends and keeps what FedAvg does."""

    name = "feduv"
    Options = FedUVOptions
    source = Source(
        authors="Son et al.",
        title="FedUV: Uniformity and Variance for Heterogeneous Federated Learning",
        venue="CVPR",
        arxiv="2402.18372", year=2024,
        implements="the classifier-variance and hyperspherical-uniformity regularisers (the paper's Section 4)",
        code="sonhamin/FedUV")

    def parts(self, opt):
        return [UniformityVariance(options_of(UVOptions, opt))]
