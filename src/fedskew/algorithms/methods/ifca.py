"""ifca: IFCA (Ghosh, Chung, Yin and Ramchandran, NeurIPS 2020): k cluster models; each client trains the one
with the lowest loss on its data. (Family ``clustered``; the class's docstring has the details.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import (
    FedAvgOptions,
    Method,
    Source,
    as_model_part,
    builtin,
    model_part,
    reference_tensor,
    weighted_mean,
)

MODELS = "ifca.models."  # the k cluster models, stacked on a first dimension


class IFCAOptions(FedAvgOptions):
    search = {"clusters": [2, 4]}  # the bench's search space (fedskew bench)
    clusters: int = Field(2, ge=1, le=64, description="k, the cluster models (the official CIFAR runs' 2, MNIST's 4)")


def cluster_losses(frozen, models: dict, k: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """F_i(theta_j) for j = 1..k: each cluster model's mean cross-entropy over the client's whole
    training data, eval mode (paper Algorithm 2, line 5)."""
    return torch.stack([F.cross_entropy(frozen({n: v[j] for n, v in models.items()}, x)[1].float(), y)
                        for j in range(k)])


def chosen_model(models: dict, onehot: torch.Tensor) -> dict:
    """The cluster model a one-hot row picks (a sum of exact zeros and one copy, so it runs under
    ``vmap`` with the row batched and the models not)."""
    return {n: (onehot.to(v.dtype).view(-1, *([1] * (v.dim() - 1))) * v).sum(0) for n, v in models.items()}


@builtin
class IFCA(Method):
    """IFCA (Ghosh, Chung, Yin and Ramchandran, NeurIPS 2020, "An Efficient Framework for Clustered
    Federated Learning", Algorithm 2 with model averaging, option II). The server keeps k cluster
    models (model 0 the run's initial model, the others independent initialisations of the same
    architecture, as the official code's k independently initialised networks) and sends all k to
    every selected client. The client estimates its cluster as argmin_j F_i(theta_j), the loss of each
    model on its whole training data (eval mode; ties to the lower index, as ``np.argmin``), trains
    that model locally as FedAvg does and uploads it with its cluster. Each cluster's model becomes
    the FedAvg mean of its members' models (weights renormalised within the cluster: by samples, or
    uniform with ``weighting=uniform`` as the official MNIST and CIFAR code); a cluster nobody chose
    keeps its model. No global model: each client is scored with its locally trained model
    (``personal/*``); ``personal/acc_before`` is its chosen cluster model. The official MNIST and
    CIFAR code picks test clients' clusters by their test loss; here the choice is always made on
    training data (the official FEMNIST rule), so no test label selects anything.

    Down: k models; up: one model and k floats. The server keeps k models."""
    family = "clustered"

    @classmethod
    def inert(cls, options, rounds, num_clients, clients_per_round):
        if options.clusters == 1:
            return "clusters = 1: one cluster model, so this run is FedAvg"

    name = "ifca"
    Options = IFCAOptions
    source = Source(
        authors="Ghosh, Chung, Yin, Ramchandran",
        title="An Efficient Framework for Clustered Federated Learning",
        venue="NeurIPS",
        year=2020,
        arxiv="2006.04088",
        implements="Algorithm 2 (cluster estimation by the lowest loss, option II: model averaging per cluster)",
        code="jichan3751/ifca (mnist and cifar trainers at 61e44b8)")
    has_global_model = False
    per_sample_loss = True  # Method.padding_exact

    def server_init(self, global_state, info):
        draws = [global_state] + [info.model_draw(j) for j in range(1, self.opt.clusters)]
        return {MODELS + k: torch.stack([d[k] for d in draws]) for k in global_state}

    def client_init(self, client_id, global_state, info):
        ref = reference_tensor(global_state)
        return {"ifca.choice": torch.zeros(self.opt.clusters, dtype=torch.float32, device=ref.device)}

    def broadcast(self, global_state, server_state):
        return dict(server_state)

    def prepare(self, payload, client_state, data):
        with torch.no_grad():
            losses = cluster_losses(data.frozen, {k[len(MODELS):]: v for k, v in payload.items()
                                                  if k.startswith(MODELS)}, self.opt.clusters, data.x, data.y)
        choice = F.one_hot(torch.argmin(losses), self.opt.clusters).to(client_state["ifca.choice"])
        return {**client_state, "ifca.choice": choice}

    def local_start(self, payload, client_state):
        return chosen_model({k[len(MODELS):]: v for k, v in payload.items() if k.startswith(MODELS)},
                            client_state["ifca.choice"])

    def after_training(self, trained, payload, client_state, report):
        return {**as_model_part(trained), "ifca.choice": client_state["ifca.choice"]}, client_state

    def aggregate(self, server_state, global_state, uploads, reports):
        weights = self.client_weights(reports)
        cluster = [int(torch.argmax(u["ifca.choice"])) for u in uploads]
        new = dict(server_state)
        for j in range(self.opt.clusters):
            members = [i for i, c in enumerate(cluster) if c == j]
            if not members:
                continue
            w = weights[members]
            mean = weighted_mean([model_part(uploads[i]) for i in members], w / w.sum())
            for k, v in mean.items():
                new[MODELS + k] = torch.cat([new[MODELS + k][:j], v[None], new[MODELS + k][j + 1:]])
        return global_state, new
