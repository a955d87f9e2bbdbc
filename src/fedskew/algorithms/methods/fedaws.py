"""fedaws: FedAwS (Yu et al., 2020): FedAvg, then ``server_steps`` gradient steps of the spreadout regulariser on
the aggregated classifier rows (server side only). (Family ``server_opt``; the class's docstring has the
details.)"""

from __future__ import annotations

import torch
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin


def spreadout(weight: torch.Tensor, margin: float) -> torch.Tensor:
    """FedAwS spreadout regulariser: mean over pairs i != j of max(margin - d_ij, 0)^2 with
    d_ij = (1 - cos(w_i, w_j)) / 2 (cosine distance of classifier rows, in [0, 1])."""
    w = torch.nn.functional.normalize(weight, dim=1)
    d = (1 - w @ w.T) / 2
    c = weight.shape[0]
    off = ~torch.eye(c, dtype=torch.bool, device=weight.device)
    return torch.relu(margin - d[off]).pow(2).mean()


class FedAwSOptions(FedAvgOptions):
    search = {'margin': [0.3, 0.5, 0.7]}  # the bench's search space (fedskew bench)
    margin: float = Field(0.5, gt=0, le=1, description="cosine-distance margin between classifier rows")
    server_steps: int = Field(5, ge=0, description=
        "gradient steps of the spreadout regulariser on the classifier rows after each aggregation (0: FedAvg)")
    server_lr: float = Field(0.1, gt=0, description="learning rate of those server steps")


@builtin
class FedAwS(Method):
    """FedAwS (Yu et al., 2020): FedAvg, then ``server_steps`` gradient steps of the spreadout
    regulariser on the aggregated classifier rows (server side only). Communication as FedAvg."""
    family = "server_opt"

    name = "fedaws"
    Options = FedAwSOptions
    source = Source(
        authors="Yu, Rawat, Menon, Kumar",
        title="Federated Learning with Only Positive Labels",
        venue="ICML",
        year=2020,
        arxiv="2004.10342",
        implements="Algorithm 1 (the server's spreadout regulariser on the classifier)",
        code="no official code; the paper's Algorithm 1")
    requires_classifier = "linear"  # it edits the classifier rows on the server

    def aggregate(self, server_state, global_state, uploads, reports):
        new, server_state = super().aggregate(server_state, global_state, uploads, reports)
        w = new["classifier.weight"].detach().clone()
        for _ in range(self.opt.server_steps):
            w.requires_grad_(True)
            (g,) = torch.autograd.grad(spreadout(w, self.opt.margin), w)
            w = (w - self.opt.server_lr * g).detach()
        new["classifier.weight"] = w
        return new, server_state
