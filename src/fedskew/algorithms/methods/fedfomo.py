"""fedfomo: FedFOMO (Zhang et al., ICLR 2021, Eq. 5-7). (Family ``sharing``; the class's docstring has the
details.)"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import (
    ClientData,
    FedAvgOptions,
    Method,
    Source,
    add_prefix,
    as_model_part,
    builtin,
    copies,
    model_part,
    reference_tensor,
    strip_prefix,
)
from fedskew.streams import numpy_rng


class FedFOMOOptions(FedAvgOptions):
    search = {'M': [3, 5]}  # the bench's search space (fedskew bench)
    M: int = Field(5, ge=1, description="models each selected client downloads (PFLlib's default)")
    epsilon: float = Field(0.3, ge=0, le=1, description="epsilon-greedy: chance of M random models instead of "
                                                        "the top-M by affinity, at round 0")
    epsilon_decay: float = Field(0.05, ge=0, description="epsilon decreases by this every round")
    val_fraction: float = Field(0.2, gt=0, lt=1, description="share of each client's training data held out "
                                                             "as its validation split D_val")


@builtin
class FedFOMO(Method):
    """FedFOMO (Zhang et al., ICLR 2021, Eq. 5-7). No global model: the server keeps the latest
    model of every client (initially the common initial model) and an affinity matrix P (identity
    at first). Each selected client i downloads M other clients' models, chosen epsilon-greedily
    (with probability epsilon_t = epsilon - t * epsilon_decay M uniformly random ones, else the
    top M of P[i]; drawn from the seed), and on its validation split D_val (``val_fraction`` of its
    data, never trained on) weighs each by its first-order gain
    w_n = max(L(theta_i) - L(theta_n), 0) / (||theta_n - theta_i|| + 1e-5), normalised to sum 1
    (all zero: the client keeps its model), and starts from
    theta_i + sum_n w_n (theta_n - theta_i) (Eq. 7; parameters and buffers). Then E epochs of CE on
    its training split; it uploads the trained model and its weights, the server stores the model
    and adds w to P[i] (reference: PFLlib's FedFomo). Losses are eval-mode CE on all of D_val;
    the distance covers the trainable parameters.

    Down: M models + M ids per client; up: the model + M weights + M ids. Keeps: own model (client),
    every client's latest model and P (server: N models). On Flower the M models travel in the
    client's ``download`` record."""
    family = "sharing"

    fedavg_weighted = False  # each client weighs the models it downloads (Method.fedavg_weighted)

    name = "fedfomo"
    Options = FedFOMOOptions
    source = Source(
        authors="Zhang et al.",
        title="Personalized Federated Learning with First Order Model Optimization",
        venue="ICLR",
        year=2021,
        arxiv="2012.08565",
        implements="Eq. 5-7",
        code="NVlabs/FedFomo")
    has_global_model = False
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss)

    @classmethod
    def validation_fraction(cls, options):
        return options.val_fraction

    def _m(self) -> int:
        return min(self.opt.M, self.info.num_clients - 1)

    def server_init(self, global_state, info):
        state = copies(global_state, info.num_clients, "fomo.models.")
        state["fomo.P"] = torch.eye(info.num_clients, dtype=torch.float64)
        return state

    def client_init(self, client_id, global_state, info):
        return add_prefix({k: v.clone() for k, v in global_state.items()}, "fomo.model.")

    def broadcast(self, global_state, server_state):
        return {}

    def download(self, server_state, client_id, round_idx):
        others = np.array([j for j in range(self.info.num_clients) if j != client_id])
        rng = numpy_rng(self.info.seed, "fedfomo", round_idx, client_id)
        eps = max(0.0, self.opt.epsilon - self.opt.epsilon_decay * round_idx)
        if rng.random() < eps:
            chosen = rng.choice(others, size=self._m(), replace=False)
        else:
            affinity = server_state["fomo.P"][client_id, torch.from_numpy(others)].numpy()
            chosen = others[np.argsort(-affinity, kind="stable")[:self._m()]]
        rows = torch.from_numpy(np.asarray(chosen, dtype=np.int64))
        out = {"fomo.cand." + k[len("fomo.models."):]: v[rows] for k, v in server_state.items()
               if k.startswith("fomo.models.")}
        out["fomo.ids"] = rows
        return out

    def prepare(self, payload, client_state, data: ClientData):
        own = strip_prefix(client_state, "fomo.model.")
        cands = strip_prefix(client_state, "fomo.cand.")
        ids = client_state["fomo.ids"]
        m = len(ids)
        weights = torch.zeros(m, dtype=torch.float64)
        if data.y_val is not None and len(data.y_val):
            call = self.info.model_call
            with torch.no_grad():
                own_loss = F.cross_entropy(call(own, data.x_val)[1], data.y_val)
                for n in range(m):
                    other = {k: v[n] for k, v in cands.items()}
                    gain = own_loss - F.cross_entropy(call(other, data.x_val)[1], data.y_val)
                    dist = torch.sqrt(sum((other[k] - own[k]).double().pow(2).sum() for k in self.info.param_names))
                    weights[n] = max(float(gain), 0.0) / (float(dist) + 1e-5)
        if weights.sum() > 0:
            weights = weights / weights.sum()
            own = {k: (v + sum(float(weights[n]) * (cands[k][n] - v) for n in range(m))).to(v.dtype)
                   if v.is_floating_point() else v for k, v in own.items()}
        state = {k: v for k, v in client_state.items() if not k.startswith("fomo.cand.")}
        ref = reference_tensor(own)
        return {**state, **add_prefix(own, "fomo.model."), "fomo.w": weights.to(device=ref.device, dtype=ref.dtype)}

    def local_start(self, payload, client_state):
        return strip_prefix(client_state, "fomo.model.")

    def after_training(self, trained, payload, client_state, report):
        upload = {**as_model_part(trained), "fomo.w": client_state["fomo.w"], "fomo.ids": client_state["fomo.ids"]}
        return upload, add_prefix(trained, "fomo.model.")

    def aggregate(self, server_state, global_state, uploads, reports):
        state = dict(server_state)
        P = state["fomo.P"].clone()
        models = {k: v.clone() for k, v in state.items() if k.startswith("fomo.models.")}
        for u, r in zip(uploads, reports):
            for k, v in model_part(u).items():
                models["fomo.models." + k][r.client_id] = v.to(models["fomo.models." + k].device)
            P[r.client_id, u["fomo.ids"].cpu()] += u["fomo.w"].cpu().double()
        return global_state, {**models, "fomo.P": P}
