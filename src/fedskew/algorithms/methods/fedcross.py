"""fedcross: FedCross (Hu et al., ICDE 2024): multi-model cross-aggregation. (Family ``clustered``; the class's
docstring has the details.)"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import (
    FedAvgOptions,
    Method,
    Source,
    as_model_part,
    builtin,
    copies,
    model_part,
    strip_prefix,
    weighted_mean,
)
from fedskew.streams import numpy_rng


class FedCrossOptions(FedAvgOptions):
    search = {"alpha": [0.9, 0.95, 0.99]}  # the bench's search space (fedskew bench)
    alpha: float = Field(0.99, gt=0, le=1, description="weight of a middleware model's own parameters in its cross "
                                                       "aggregation (the rest: its collaborative model's)")
    strategy: Literal["lowest", "highest", "in_order"] = Field(
        "lowest", description="collaborative model: the least similar (PFLlib's default), the most similar, or the "
                              "one (round mod (K - 1)) + 1 slots further")
    first_stage_rounds: int = Field(0, ge=0, description="rounds before cross aggregation starts, in which every "
                                                         "middleware model is reset to the global model")
    buffers: Literal["pflib", "own"] = Field(
        "pflib", description="buffers (BatchNorm statistics) of a middleware model: pflib: the cross step copies "
                             "those of the lower-indexed model of the pair, the first stage resets parameters only "
                             "(PFLlib's aggregate_parameters_cross and train); own: each keeps its own in the cross "
                             "step, the first stage resets the whole state")


def layer_pair_similarity(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """PFLlib's FedCross similarity of two models given as their state tensors in order: the sum of
    the cosine similarities of consecutive pairs of flattened tensors (weight with bias), the last
    pair (or a last single tensor) counted once more (``servercross.calculate_similarity``)."""
    s, sub_a, sub_b = 0.0, None, None
    for i, (x, y) in enumerate(zip(a, b)):
        x, y = x.reshape(-1).double(), y.reshape(-1).double()
        sub_a, sub_b = (x, y) if i % 2 == 0 else (torch.cat([sub_a, x]), torch.cat([sub_b, y]))
        if i % 2 == 1:
            s += float(F.cosine_similarity(sub_a, sub_b, dim=0))
    return s + float(F.cosine_similarity(sub_a, sub_b, dim=0))


def collaborator(sim: np.ndarray, j: int, strategy: str, round_idx: int) -> int:
    """The model middleware model j is aggregated with (``servercross.cross_aggregation``):
    ``lowest``: the least similar other model (ties: the first, starting from j + 1); ``highest``:
    the most similar (ties: the first, starting from 0; the diagonal is 0 as in PFLlib);
    ``in_order``: j + (round mod (K - 1)) + 1, modulo K."""
    k = len(sim)
    if strategy == "in_order":
        return (j + round_idx % (k - 1) + 1) % k
    if strategy == "highest":
        best = 0
        for p in range(k):
            if sim[j, p] > sim[j, best]:
                best = p
        return best
    low = (j + 1) % k
    for p in range(k):
        if sim[j, p] < sim[j, low] and p != j:
            low = p
    return low


@builtin
class FedCross(Method):
    """FedCross (Hu et al., ICDE 2024): multi-model cross-aggregation. The server
    keeps K middleware models (K = clients per round), each trained by one selected client a round
    (a random assignment, drawn from the seed: PFLlib gives model i to the i-th client of its random
    selection); after training, middleware model j becomes alpha w_j + (1 - alpha) w_c, w_c its
    collaborative model (the least similar by PFLlib's layer-pair cosine, by default); its buffers
    are those of the lower-indexed model of the pair (``buffers=pflib``: PFLlib's
    ``aggregate_parameters_cross`` deep-copies the pair's first model and averages its parameters
    only; ``own``: its own). The global model, which
    the metrics score, is the n_k-weighted mean of the trained middleware models; it only seeds the
    middleware models during ``first_stage_rounds`` and serves the final personalisation pass."""
    family = "clustered"

    @classmethod
    def inert(cls, options, rounds, num_clients, clients_per_round):
        if options.first_stage_rounds >= rounds:
            return (f"first_stage_rounds = {options.first_stage_rounds} is not below rounds = {rounds}: cross "
                    f"aggregation never starts, every middleware model is the global model every round")

    name = "fedcross"
    Options = FedCrossOptions
    source = Source(authors="Hu, Zhou, Yue, Ling, Huang, Li, Liu, Lian, Chen",
                    title="FedCross: Towards Accurate Federated Learning via Multi-Model Cross-Aggregation",
                    venue="ICDE", year=2024, arxiv="2210.08285",
                    implements="Algorithm 1 (middleware models, cross aggregation with a collaborative model)",
                    code="TsingZ0/PFLlib system/flcore/servers/servercross.py, clients/clientcross.py (defaults "
                         "fedcross_alpha 0.99, collaberative_model_select_strategy 1, first_stage_bound 0)")
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss)

    def _k(self) -> int:
        return max(1, min(self.info.clients_per_round, self.info.num_clients))

    def server_init(self, global_state, info):
        k = self._k()
        state = copies(global_state, k, "cross.models.")
        return {**state, "cross.slot": torch.full((info.num_clients,), -1, dtype=torch.long),
                "cross.round": torch.zeros((), dtype=torch.long)}

    def round_start(self, server_state, clients, round_idx):
        slots = numpy_rng(self.info.seed, "fedcross", round_idx).permutation(self._k())[:len(clients)]
        slot = torch.full_like(server_state["cross.slot"], -1)
        slot[torch.tensor(clients, dtype=torch.long)] = torch.from_numpy(slots.astype(np.int64))
        return {**server_state, "cross.slot": slot, "cross.round": torch.tensor(round_idx)}

    def broadcast(self, global_state, server_state):
        # a training round sends each client its middleware model alone (``download``); the final
        # pass (no slots) sends the global model
        return {} if bool((server_state["cross.slot"] >= 0).any()) else as_model_part(global_state)

    def download(self, server_state, client_id, round_idx):
        j = int(server_state["cross.slot"][client_id])
        if j < 0:
            return {}
        return {"cross.model." + n[len("cross.models."):]: v[j] for n, v in server_state.items()
                if n.startswith("cross.models.")}

    def local_start(self, payload, client_state):
        own = strip_prefix(client_state, "cross.model.")
        return own if own else model_part(payload)

    def after_training(self, trained, payload, client_state, report):
        return as_model_part(trained), {k: v for k, v in client_state.items() if not k.startswith("cross.model.")}

    def aggregate(self, server_state, global_state, uploads, reports):
        slot, names = server_state["cross.slot"], list(global_state)
        models = {n: server_state["cross.models." + n].clone() for n in names}
        for u, r in zip(uploads, reports):  # the trained middleware models back in their slots
            for n, v in model_part(u).items():
                models[n][int(slot[r.client_id])] = v.to(models[n].device)
        new = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        k, t = self._k(), int(server_state["cross.round"])
        params, pflib = set(self.info.param_names), self.opt.buffers == "pflib"
        if t < self.opt.first_stage_rounds:  # PFLlib resets the middleware models' parameters only
            models = {n: copies({n: v}, k)[n] if n in params or not pflib else models[n] for n, v in new.items()}
        elif k > 1:
            rows = [[models[n][j] for n in names] for j in range(k)]
            sim = np.zeros((k, k))
            for a in range(k):
                for b in range(a):
                    sim[a, b] = sim[b, a] = layer_pair_similarity(rows[a], rows[b])
            partner = [collaborator(sim, j, self.opt.strategy, t) for j in range(k)]
            alpha = self.opt.alpha
            keep = [min(j, partner[j]) if pflib else j for j in range(k)]  # whose buffers model j takes
            models = {n: torch.stack([alpha * v[j] + (1 - alpha) * v[partner[j]] if n in params else v[keep[j]]
                                      for j in range(k)]) for n, v in models.items()}
        state = {**{"cross.models." + n: v for n, v in models.items()},
                 "cross.slot": torch.full_like(slot, -1), "cross.round": server_state["cross.round"]}
        return new, state
