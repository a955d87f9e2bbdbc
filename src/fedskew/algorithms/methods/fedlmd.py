"""fedlmd: FedLMD (Lu et al., ACM MM 2023; official code wnma3mz/FedLMD): L = CE(z, y) + beta * :func:`lmd_loss`(z,
frozen received global model's logits): the global model teaches the classes the client has few or none of (its
major classes and the sample's true class masked from the teacher). (Family ``fedka``; the class's docstring has
the details.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin, model_part, reference_tensor


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
    family = "fedka"

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
