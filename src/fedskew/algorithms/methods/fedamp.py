"""fedamp: FedAMP (Huang et al., AAAI 2021, "Personalized Cross-Silo Federated Learning on Non-IID Data", Eq. 5-7).
(Family ``sharing``; the class's docstring has the details.)"""

from __future__ import annotations

import torch
from pydantic import Field

from fedskew.algorithms.base import (
    FedAvgOptions,
    Method,
    Source,
    State,
    add_prefix,
    as_model_part,
    builtin,
    copies,
    reference_tensor,
    strip_prefix,
)


class FedAMPOptions(FedAvgOptions):
    search = {"sigma": [0.1, 1.0, 10.0], "lam": [None, 0.1, 1.0]}  # the bench's search space (fedskew bench)
    alpha: float | None = Field(None, gt=0, description=
        "alpha_k, the step on the attention regulariser; None: sigma / (N - 1), the largest step for which every xi_ii "
        ">= 0 whatever the distances (u_i a convex combination); PFLlib's default is 1.0")
    sigma: float = Field(1.0, gt=0, description=
        "sigma of A(x) = 1 - exp(-x / sigma), so A'(x) = exp(-x / sigma) / sigma (PFLlib's default)")
    lam: float | None = Field(None, ge=0, description=
        "lambda: the local proximal weight is lambda / (2 alpha); None: lambda = alpha (weight 1/2, whatever N); "
        "PFLlib's default is 1.0")


@builtin
class FedAMP(Method):
    """FedAMP (Huang et al., AAAI 2021, "Personalized Cross-Silo Federated Learning on Non-IID
    Data", Eq. 5-7). No global model: every client trains its own model w_i; the server keeps the
    latest model of every client (trainable parameters) and, for each selected client, passes
    attentive messages: u_i = sum_j xi_ij w_j with xi_ij = alpha A'(||w_i - w_j||^2) for j != i,
    A'(x) = exp(-x / sigma) / sigma (A(x) = 1 - exp(-x / sigma)), and xi_ii = 1 - sum_{j != i} xi_ij
    (Eq. 5, a gradient step of alpha on the regulariser sum_{i<j} A(||w_i - w_j||^2)). The client
    downloads its cloud model u_i and trains its own model, from where it stopped, on
    CE + lambda / (2 alpha) ||w - u_i||^2 over the trainable parameters, every batch (Eq. 7, the
    proximal step), and uploads it. j runs over the other clients the server has a trained model of
    (the paper: all clients, each taking part every round; with sampling, each one's latest model);
    never-trained clients are the common initial model. ``fedamp/self_weight`` logs xi_ii: near 1,
    the attention is negligible and FedAMP is local training with a proximal pull to the round's
    start; below 0, u_i extrapolates away from the peers.

    Defaults: alpha = sigma / (N - 1) keeps u_i a convex combination (A' <= 1 / sigma), and lambda = alpha a proximal
    weight of 1/2 at any N. PFLlib's alphaK = lamda = sigma = 1 gave xi_ii near -3 on digits (docs/methods.md has the
    runs). Where the references differ: PFLlib's client adds lambda / (2 alpha) ||w - u|| (a norm, not its square) on
    detached tensors, so its proximal term has no gradient, and its server mixes the previous round's uploads only;
    fluke's mixes the round's uploads after training and takes alpha = the learning rate in the client's term. Both are
    read, neither copied; the paper's equations are followed. The paper's heuristic variant for deep models (HeurFedAMP,
    cosine similarity) is not built.

    Down: u_i (the trainable parameters) and xi_ii. Up: the model. Keeps: its own model (client);
    every client's latest parameters (server: N models). On Flower u_i travels in the client's
    ``download`` record."""
    family = "sharing"

    fedavg_weighted = False  # the server mixes per client by attention (Method.fedavg_weighted)

    name = "fedamp"
    Options = FedAMPOptions
    source = Source(
        authors="Huang et al.",
        title="Personalized Cross-Silo Federated Learning on Non-IID Data",
        venue="AAAI",
        year=2021,
        arxiv="2007.03797",
        implements="Eq. 5-7",
        code="no official code; PFLlib's serveramp.py and fluke's fedamp.py read")
    has_global_model = False
    per_sample_loss = True  # Method.padding_exact: CE + a term of the parameters alone

    def alpha(self) -> float:
        return self.opt.alpha if self.opt.alpha is not None else self.opt.sigma / max(self.info.num_clients - 1, 1)

    def prox_weight(self) -> float:
        """lambda / (2 alpha) (Eq. 7)."""
        return 0.5 if self.opt.lam is None else self.opt.lam / (2 * self.alpha())

    def server_init(self, global_state, info):
        state = copies({k: global_state[k] for k in info.param_names}, info.num_clients, "amp.models.")
        state["amp.seen"] = torch.zeros(info.num_clients, dtype=torch.bool)
        return state

    def client_init(self, client_id, global_state, info):
        return add_prefix({k: v.clone() for k, v in global_state.items()}, "amp.model.")

    def broadcast(self, global_state, server_state):
        return {}

    def download(self, server_state, client_id, round_idx):
        models = strip_prefix(server_state, "amp.models.")
        xi = attention_weights(models, server_state["amp.seen"], client_id, self.alpha(), self.opt.sigma)
        out = {"amp.u." + k: torch.einsum("n,n...->...", xi.to(v.dtype), v) for k, v in models.items()}
        out["amp.self_weight"] = xi[client_id].to(reference_tensor(models).dtype)
        return out

    def local_start(self, payload, client_state):
        return strip_prefix(client_state, "amp.model.")

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
        prox = sum((p - client_state["amp.u." + k]).pow(2).sum() for k, p in params.items())
        return (loss + self.prox_weight() * prox,
                {**aux, "fedamp/prox": prox.detach(), "fedamp/self_weight": client_state["amp.self_weight"]})

    def after_training(self, trained, payload, client_state, report):
        return as_model_part(trained), add_prefix(trained, "amp.model.")

    def aggregate(self, server_state, global_state, uploads, reports):
        state = {k: v.clone() for k, v in server_state.items()}
        for u, r in zip(uploads, reports):
            for k in self.info.param_names:
                state["amp.models." + k][r.client_id] = u["model." + k].to(state["amp.models." + k].device)
            state["amp.seen"][r.client_id] = True
        return global_state, state


def attention_weights(models: State, seen: torch.Tensor, i: int, alpha: float, sigma: float) -> torch.Tensor:
    """FedAMP's row xi_i. of Eq. 5 (float64): xi_ij = alpha exp(-||w_i - w_j||^2 / sigma) / sigma for
    every other client j with ``seen[j]``, 0 for the rest, and xi_ii = 1 - sum_{j != i} xi_ij.
    ``models`` maps a parameter name to the stacked [N, ...] parameters of all N clients."""
    sq = sum(torch.linalg.vector_norm((v - v[i]).flatten(1), dim=1, dtype=torch.float64) ** 2 for v in models.values())
    xi = alpha * torch.exp(-sq / sigma) / sigma
    peers = seen.to(xi.device).clone()
    peers[i] = False
    xi = torch.where(peers, xi, torch.zeros_like(xi))
    xi[i] = 1.0 - xi.sum()
    return xi
