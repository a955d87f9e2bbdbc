"""fedvls: FedVLS (Guo et al., AAAI 2025, "Exploring vacant classes in label-skewed FL"; official code
krumpguo/FedVLS): L = :func:`prior_ce` + :func:`logit_suppression` + lambda * :func:`vacant_distillation`
against the frozen received global model. (Family ``fedka``; the class's docstring has the details.)"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin, model_part, reference_tensor


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
    family = "fedka"

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
