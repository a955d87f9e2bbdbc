"""moon: MOON: CE + mu * model-contrastive loss between the features of the local model, the frozen received global
model (positive) and the client's previous local model (negative). (Family ``representation``; the class's
docstring has the details.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin, model_part


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
    # seed 0; benchmarks/health_fmnist.py)
    mu: float = Field(1.0, ge=0, description="weight of the contrastive term (paper: 5 CIFAR-10, 1 CIFAR-100)")
    temperature: float = Field(0.5, gt=0, description="tau of the model-contrastive loss")


@builtin
class Moon(Method):
    """MOON: CE + mu * model-contrastive loss between the features of the local model, the frozen
    received global model (positive) and the client's previous local model (negative). In a
    client's first round there is no previous model and the term is zero. Use
    ``model.projection_dim=256`` for the paper's projection head.

    Down |theta|, up |theta|; the client keeps its previous local model (|theta|)."""
    family = "representation"

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
