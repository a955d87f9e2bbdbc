"""floco: Floco (Grinwald, Wiesner, Nakajima, NeurIPS 2024), as FL-bench's ``floco`` runs it: the classifier is a
simplex of M endpoint weights (:class:`~fedskew.models.nets. (Family ``personalized``; the class's docstring has
the details.)"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field
from torch import nn

from fedskew.algorithms.base import (
    MODEL,
    FedAvgOptions,
    Method,
    Source,
    as_model_part,
    builtin,
    model_part,
    weighted_mean,
)


class FlocoOptions(FedAvgOptions):
    search = {"rho": [0.05, 0.1, 0.2], "tau": [5, 10]}  # the bench's search space (fedskew bench)
    endpoints: int = Field(10, ge=2, le=64, description="M, the simplex's endpoints (classifier weights)")
    tau: int = Field(10, ge=1, description="the round (from 0) before which the clients are projected onto the "
                                           "simplex")
    rho: float = Field(0.1, ge=0, description="radius of each client's L1 ball around its projected point")


def simplex_projection(kappas: np.ndarray, z: float) -> np.ndarray:
    """Each row of ``kappas`` projected onto the simplex {b >= 0, sum b = z} (FL-bench's
    ``_project_client_onto_simplex``, the sort-based Euclidean projection)."""
    ordered = np.sort(kappas, axis=1)[:, ::-1]
    cssv = np.cumsum(ordered, axis=1) - z
    ind = np.arange(kappas.shape[1]) + 1
    count = np.count_nonzero(ordered - cssv / ind > 0, axis=1)
    theta = cssv[np.arange(len(kappas)), count - 1] / count
    return np.maximum(kappas - theta[:, None], 0)


def riesz_log_energy(points: np.ndarray) -> float:
    """log(mean over pairs of 1 / ||b_i - b_j||^2), distances floored at 1e-4 (FL-bench's
    ``_riesz_s_energy``): low when the points spread over the simplex."""
    dist = np.sqrt(((points[:, None] - points[None, :]) ** 2).sum(2))
    pairs = np.maximum(dist[np.triu_indices(len(points), 1)], 1e-4)
    return float(np.log((1 / pairs ** 2).sum()) - np.log(len(pairs)))


def project_clients(signatures: np.ndarray, endpoints: int) -> np.ndarray:
    """Floco's projection (FL-bench's ``project_clients``): the clients' classifier endpoints
    reduced by PCA to M dimensions (``svd_solver='full'``: deterministic; fewer clients than M: the
    missing components are 0), projected onto simplices of sizes z in linspace(1e-4, 1, 1000), each
    row renormalised; the z whose points have the lowest Riesz energy wins."""
    from sklearn.decomposition import PCA

    k = min(endpoints, len(signatures))
    kappas = np.zeros((len(signatures), endpoints))
    kappas[:, :k] = PCA(n_components=k, svd_solver="full").fit_transform(signatures)
    best, lowest = None, np.inf
    for z in np.linspace(1e-4, 1, 1000):
        betas = simplex_projection(kappas, z)
        betas = betas / betas.sum(1, keepdims=True)
        energy = riesz_log_energy(betas) if len(betas) > 1 else 0.0
        if np.isfinite(energy) and energy < lowest:
            best, lowest = betas, energy
    return best


@builtin
class Floco(Method):
    """Floco (Grinwald, Wiesner, Nakajima, NeurIPS 2024), as FL-bench's ``floco`` runs
    it: the classifier is a simplex of M endpoint weights (:class:`~fedskew.models.nets.
    SimplexLinear`), trained at a random point of the simplex every step; FedAvg averages the whole
    model. After round tau - 1 the server projects the clients onto the simplex by their trained
    endpoints (``project_clients``); from then on each client trains at random points of the L1 ball
    of radius rho around its own point beta_k, and its personalised model is the classifier at
    beta_k. The global model is the classifier at the simplex's centre."""
    family = "personalized"

    @classmethod
    def inert(cls, options, rounds, num_clients, clients_per_round):
        if options.tau >= rounds:
            return (f"tau = {options.tau} is not below rounds = {rounds}: the clients are never projected onto "
                    f"their subregions of the simplex")

    name = "floco"
    Options = FlocoOptions
    source = Source(authors="Grinwald, Wiesner, Nakajima",
                    title="Federated Learning over Connected Modes", venue="NeurIPS", year=2024, arxiv="2403.03333",
                    implements="Floco (solution simplex, projection of the clients by their endpoint weights, "
                               "subregion training); not Floco+ (pers_epoch 0, FL-bench's default)",
                    code="KarhouTam/FL-bench src/server/floco.py, src/client/floco.py (endpoints 10, tau 10, rho 0.1)")
    requires_classifier = "linear"
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss)

    @classmethod
    def build_model(cls, model, options, rebuild):
        """The classifier becomes M endpoints, each Xavier-normal (FL-bench's ``_initialize_weight``),
        with the configured classifier's bias."""
        head = model.classifier
        ends = torch.stack([nn.init.xavier_normal_(torch.empty_like(head.weight)) for _ in range(options.endpoints)])
        bias = head.bias.detach().clone() if head.bias is not None else torch.zeros(head.out_features)
        from fedskew.models.nets import SimplexLinear

        model.classifier = SimplexLinear(ends, bias)
        return model

    def server_init(self, global_state, info):
        ends = global_state["classifier.endpoints"]
        m = ends.shape[0]
        return {"floco.signatures": torch.zeros(info.num_clients, ends.numel(), dtype=ends.dtype),
                "floco.seen": torch.zeros(info.num_clients, dtype=torch.bool),
                "floco.center": torch.full((info.num_clients, m), 1.0 / m, dtype=ends.dtype),
                "floco.on": torch.zeros(info.num_clients, dtype=ends.dtype),
                "floco.round": torch.zeros((), dtype=torch.long)}

    def download(self, server_state, client_id, round_idx):
        return {
            "floco.center": server_state["floco.center"][client_id],
            "floco.on": server_state["floco.on"][client_id],
        }

    def _subregion(self, state, client_state):
        on = client_state["floco.on"]
        return {**state, "classifier.center": client_state["floco.center"], "classifier.projected": on,
                "classifier.radius": on * self.opt.rho}

    def local_start(self, payload, client_state):
        return self._subregion(model_part(payload), client_state)

    def after_training(self, trained, payload, client_state, report):
        glob = model_part(payload)
        shared = {**trained, **{k: glob[k] for k in ("classifier.center", "classifier.projected", "classifier.radius")}}
        return as_model_part(shared), client_state

    def personal_state(self, trained, client_state):
        return self._subregion(trained, client_state)

    def aggregate(self, server_state, global_state, uploads, reports):
        new = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        state = {k: v.clone() for k, v in server_state.items()}
        for u, r in zip(uploads, reports):
            state["floco.signatures"][r.client_id] = u[MODEL + "classifier.endpoints"].reshape(-1).cpu()
            state["floco.seen"][r.client_id] = True
        state["floco.round"] = server_state["floco.round"] + 1
        if int(state["floco.round"]) == self.opt.tau:  # FL-bench projects when its round counter reaches tau
            seen = torch.nonzero(state["floco.seen"]).flatten()
            betas = project_clients(state["floco.signatures"][seen].double().numpy(), self.opt.endpoints)
            state["floco.center"][seen] = torch.from_numpy(betas).to(state["floco.center"])
            state["floco.on"][seen] = 1
        return new, state
