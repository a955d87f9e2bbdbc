"""fedproc: FedProc = its loss + FedMR's prototype machinery (class means up, count-weighted global prototypes
down) with no margin term. (Family ``representation``; the class's docstring has the details.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin
from fedskew.algorithms.components import PrototypeMargin, PrototypeOptions
from fedskew.algorithms.compose import Composed


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
    family = "representation"

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
