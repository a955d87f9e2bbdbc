"""fedlc: FedLC: FedAvg whose local loss calibrates each logit by the client's label counts before the softmax
(training only; evaluation uses plain logits). (Family ``personalized``; the class's docstring has the details.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin, reference_tensor


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
    family = "personalized"

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
