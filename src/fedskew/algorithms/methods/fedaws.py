"""fedaws: FedAwS (Yu et al., 2020): FedAvg, then ``server_steps`` steps of the spreadout regulariser on the
aggregated classifier rows (server side only), in the paper's form or in the form of the code behind the MAP
paper's FedAwS numbers (lxcnju/FedRepo). (Family ``server_opt``; the class's docstring has the details.)"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin

FEDREPO_MOMENTUM = 0.9  # FedRepo's server optimiser: SGD, momentum 0.9 (no weight decay), built afresh each round


def spreadout(weight: torch.Tensor, margin: float, diagonal: bool = False) -> torch.Tensor:
    """FedAwS spreadout regulariser: the mean of max(margin - d_ij, 0)^2 with d_ij = (1 - cos(w_i, w_j)) / 2
    (cosine distance of classifier rows, in [0, 1]), over the pairs i != j (the paper's Algorithm 1), or
    with ``diagonal`` over all C x C entries, the diagonal's d_ii set to 0 (FedRepo's ``SpreadModel``:
    each diagonal entry adds margin^2 and no gradient, so the gradient is (C - 1) / C of the other's)."""
    w = torch.nn.functional.normalize(weight, dim=1)
    d = (1 - w @ w.T) / 2
    c = weight.shape[0]
    eye = torch.eye(c, dtype=torch.bool, device=weight.device)
    if diagonal:
        return torch.relu(margin - d.masked_fill(eye, 0.0)).pow(2).mean()
    return torch.relu(margin - d[~eye]).pow(2).mean()


class FedAwSOptions(FedAvgOptions):
    search = {'margin': [0.3, 0.5, 0.7]}  # the bench's search space (fedskew bench)
    margin: float = Field(0.5, gt=0, le=1, description="cosine-distance margin between classifier rows")
    server_steps: int = Field(5, ge=0, description=
        "steps of the spreadout regulariser on the classifier rows after each aggregation (0: FedAvg)")
    server_lr: float = Field(0.1, gt=0, description="learning rate of those server steps")
    form: Literal["paper", "fedrepo"] = Field("paper", description=
        "paper: plain gradient steps on the mean over the pairs i != j (Algorithm 1); fedrepo: the code behind "
        "the MAP paper's FedAwS numbers (lxcnju/FedRepo): SGD with momentum 0.9, new each round, on the mean "
        "over all C x C entries")


def server_steps(weight: torch.Tensor, opt: FedAwSOptions) -> torch.Tensor:
    """The classifier rows after ``opt.server_steps`` steps on the spreadout regulariser."""
    w, velocity = weight.detach().clone(), None
    momentum = FEDREPO_MOMENTUM if opt.form == "fedrepo" else 0.0
    for _ in range(opt.server_steps):
        w.requires_grad_(True)
        (g,) = torch.autograd.grad(spreadout(w, opt.margin, diagonal=opt.form == "fedrepo"), w)
        velocity = g if velocity is None else momentum * velocity + g  # (torch.optim.SGD's buffer)
        w = (w - opt.server_lr * velocity).detach()
    return w


@builtin
class FedAwS(Method):
    """FedAwS (Yu et al., 2020): FedAvg, then ``server_steps`` steps of the spreadout regulariser on
    the aggregated classifier rows (server side only). Communication as FedAvg.

    ``form=paper`` (the default) takes plain gradient steps on the mean over the pairs i != j, the
    paper's Algorithm 1 (the paper released no code). ``form=fedrepo`` is the code the MAP paper's
    FedAwS cells were produced with (lxcnju/FedRepo, ``algorithms/fedaws.py``): SGD with momentum 0.9,
    its buffer new each round, on the mean over all C x C entries (the diagonal at distance 0); FedRepo
    searches the pairs (margin 0.8, 30 steps, lr 0.1) and (margin 0.5, 50 steps, lr 0.01); the
    seed-papers suite's MAP part runs the first (a grid there would hold a validation split out of
    every run of the part, which MAP's protocol does not). Its other differences from fedskew's FedAvg (an
    unweighted mean of the uploads, a bias-free classifier) are the settings ``method.weighting`` and
    ``model.classifier_bias``."""
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
        code="no official code; the paper's Algorithm 1 (form=fedrepo: lxcnju/FedRepo, the MAP paper's authors' code, "
             "at 617ee015)")
    requires_classifier = "linear"  # it edits the classifier rows on the server

    def aggregate(self, server_state, global_state, uploads, reports):
        new, server_state = super().aggregate(server_state, global_state, uploads, reports)
        new["classifier.weight"] = server_steps(new["classifier.weight"], self.opt)
        return new, server_state
