"""cfl: Clustered FL (Sattler, Mueller and Samek, IEEE TNNLS 2021, Algorithm 1; FL-bench's ``cfl``). (Family
``clustered``; the class's docstring has the details.)"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import Method, Source, StrictOptions, as_model_part, builtin, model_part, strip_prefix

SENT_CFL = "cfl.model."  # the client's cluster model, downloaded for the round


class CFLOptions(StrictOptions):
    search = {"eps_1": [0.2, 0.4], "eps_2": [0.8, 1.6]}  # the bench's search space (fedskew bench)
    eps_1: float = Field(0.4, gt=0, allow_inf_nan=False,
                         description="split a cluster when the norm of its members' mean update is below it")
    eps_2: float = Field(1.6, gt=0, allow_inf_nan=False,
                         description="... and the largest member update norm is above it")
    min_cluster_size: int = Field(2, ge=1, description="... and it has more members than this")
    start_round: int = Field(20, ge=0, description="... from this round on (counted from 0)")


def bipartition(similarity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CFL's split (Sattler et al., Algorithm 1): two groups of a cluster's members by complete-linkage
    agglomerative clustering on the distance -similarity (FL-bench's ``cluster_clients``)."""
    from sklearn.cluster import AgglomerativeClustering

    labels = AgglomerativeClustering(metric="precomputed", linkage="complete").fit(-similarity).labels_
    return np.flatnonzero(labels == 0), np.flatnonzero(labels == 1)


@builtin
class CFL(Method):
    """Clustered FL (Sattler, Mueller and Samek, IEEE TNNLS 2021, Algorithm 1; FL-bench's ``cfl``).
    Every client trains its cluster's model; the server averages each cluster's updates (uniform
    weights) into that cluster's model. A cluster whose members' mean update is small (norm <
    eps_1: near a stationary point of their joint objective) while one member's update is large
    (norm > eps_2: they disagree), with more than ``min_cluster_size`` members, from round
    ``start_round`` on, is split in two by complete-linkage clustering of the cosine similarities of
    the round's updates (clients that did not train this round: similarity 0 to the others, as in
    FL-bench); both halves start from its model. No global model: each client is scored with its
    locally trained model (``personal/*``), its cluster's model being the final pass's
    ``personal/final_acc_before``."""
    family = "clustered"

    @classmethod
    def inert(cls, options, rounds, num_clients, clients_per_round):
        if options.start_round >= rounds:
            return (f"start_round = {options.start_round} is not below rounds = {rounds}: no cluster is ever split, "
                    f"so this run is FedAvg")
        if options.min_cluster_size >= num_clients:
            return (f"min_cluster_size = {options.min_cluster_size} is not below the {num_clients} clients: a "
                    f"cluster needs more members than that to split, so none is ever split and this run is FedAvg")

    name = "cfl"
    Options = CFLOptions
    source = Source(authors="Sattler, Mueller, Samek",
                    title="Clustered Federated Learning: Model-Agnostic Distributed Multitask Optimization "
                          "Under Privacy Constraints", venue="IEEE TNNLS", year=2021, arxiv="1910.01991",
                    implements="Algorithm 1 (the split criterion Eq. 27-28 with eps_1, eps_2; bipartition)",
                    code="KarhouTam/FL-bench src/server/cfl.py (the split, its defaults, uniform cluster means)")
    has_global_model = False
    fedavg_weighted = False  # uniform means within each cluster (Method.fedavg_weighted)
    per_sample_loss = True  # Method.padding_exact

    def server_init(self, global_state, info):
        state = {"cfl.cluster": torch.zeros(info.num_clients, dtype=torch.long),
                 "cfl.rounds": torch.zeros((), dtype=torch.long)}
        state.update({"cfl.models." + k: global_state[k][None].clone() for k in info.param_names})
        return state

    def broadcast(self, global_state, server_state):
        return {}  # every client gets its cluster's model (download)

    def download(self, server_state, client_id, round_idx):
        c = int(server_state["cfl.cluster"][client_id])
        return {SENT_CFL + k: server_state["cfl.models." + k][c] for k in self.info.param_names}

    def local_start(self, payload, client_state):
        return strip_prefix({k: v for k, v in client_state.items() if k.startswith(SENT_CFL)}, SENT_CFL)

    def after_training(self, trained, payload, client_state, report):
        return as_model_part(trained), {k: v for k, v in client_state.items() if not k.startswith(SENT_CFL)}

    def aggregate(self, server_state, global_state, uploads, reports):
        o, names = self.opt, self.info.param_names
        cluster, models = server_state["cfl.cluster"].clone(), {k: server_state["cfl.models." + k] for k in names}
        ids = [r.client_id for r in reports]
        # each participant's update: its trained model minus its cluster's model
        diffs = {k: torch.cat([(model_part(u)[n] - models[n][cluster[k]]).flatten() for n in names])
                 for k, u in zip(ids, uploads)}
        n = self.info.num_clients
        sim = np.eye(n)
        for i, a in enumerate(ids):
            for b in ids[i + 1:]:
                sim[a, b] = sim[b, a] = float(F.cosine_similarity(diffs[a], diffs[b], dim=0, eps=1e-12))
        rounds = int(server_state["cfl.rounds"])
        groups = []
        for c in range(int(cluster.max()) + 1):
            members = np.flatnonzero(cluster.numpy() == c)
            present = [diffs[k] for k in members if k in diffs]
            mean_norm = float(torch.stack(present).mean(0).norm()) if present else 0.0
            max_norm = max((float(d.norm()) for d in present), default=0.0)
            if (mean_norm < o.eps_1 and max_norm > o.eps_2 and len(members) > o.min_cluster_size
                    and rounds >= o.start_round):
                a, b = bipartition(sim[np.ix_(members, members)])
                groups += [(c, members[a]), (c, members[b])]
            else:
                groups.append((c, members))
        new_cluster = torch.empty_like(cluster)
        new_models = {k: [] for k in names}
        for g, (old, members) in enumerate(groups):
            new_cluster[torch.as_tensor(members, dtype=torch.long)] = g
            present = [k for k in members if k in diffs]
            for k in names:
                model = models[k][old]
                if present:
                    model = model + torch.stack([model_part(uploads[ids.index(j)])[k] - models[k][old]
                                                 for j in present]).mean(0)
                new_models[k].append(model)
        state = {"cfl.cluster": new_cluster, "cfl.rounds": torch.tensor(rounds + 1)}
        state.update({"cfl.models." + k: torch.stack(v) for k, v in new_models.items()})
        return global_state, state
