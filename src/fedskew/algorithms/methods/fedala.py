"""fedala: FedALA (Zhang et al., AAAI 2023): adaptive local aggregation. (Family ``sharing``; the class's docstring
has the details.)"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from fedskew.algorithms.base import (
    ClientData,
    FedAvgOptions,
    Method,
    Source,
    add_prefix,
    as_model_part,
    builtin,
    model_part,
    reference_tensor,
    strip_prefix,
)
from fedskew.algorithms.sharing import ala_epoch
from fedskew.streams import numpy_rng


class FedALAOptions(FedAvgOptions):
    search = {'eta': [0.1, 1.0]}  # the bench's search space (fedskew bench)
    eta: float = Field(1.0, gt=0, description="learning rate of the aggregation weights")
    rand_percent: float = Field(80, gt=0, le=100, description="percent of the local data the weights learn on (s)")
    layer_idx: int = Field(2, ge=0, description="number of last parameter tensors ALA applies to (p; 0: all); "
                                                "lower ones take the global model's values")
    threshold: float = Field(0.1, gt=0, description="first ALA: learn until the std of the last num_pre_loss "
                                                    "epoch losses is below this")
    num_pre_loss: int = Field(10, ge=2, description=
        "how many recent epoch losses the first ALA's stopping test takes the std of")
    max_start_epochs: int = Field(100, ge=1, description="cap on the first ALA's epochs (the official code has none)")


@builtin
class FedALA(Method):
    """FedALA (Zhang et al., AAAI 2023): adaptive local aggregation. Before local training a
    client initialises its model from its previous local model theta and the received global
    model theta_g, element-wise (Eq. 4-5): theta_hat = theta + (theta_g - theta) * W for the last
    ``layer_idx`` parameter tensors (lower ones: theta_g's values), with W in [0, 1] learned on a
    random ``rand_percent`` of the local data (a contiguous slice at a random start, in order,
    full batches of B, as in the official code TsingZ0/FedALA): per batch,
    W <- clip(W - eta * grad_theta_hat L * (theta_g - theta), 0, 1) (Eq. 6). W is kept per client
    across rounds (initially ones). At the client's first ALA it learns until the standard
    deviation of the last ``num_pre_loss`` epoch losses is below ``threshold`` (capped here at
    ``max_start_epochs``), later one epoch. As in the official code, ALA is skipped while the
    global model's first parameter tensor sums to the local one's (the first round). Then FedAvg's
    local training; the locally trained model is uploaded and kept. The loss for W is the
    training-mode forward (BatchNorm statistics of the batch, running statistics not updated).

    Down and up: what FedAvg sends. Keeps a full model and W per client."""
    family = "sharing"

    name = "fedala"
    Options = FedALAOptions
    source = Source(
        authors="Zhang et al.",
        title="FedALA: Adaptive Local Aggregation for Personalized Federated Learning",
        venue="AAAI",
        year=2023,
        arxiv="2212.01197",
        implements="Eq. 4-6 (adaptive local aggregation)",
        code="TsingZ0/FedALA")

    def _ala_names(self) -> list[str]:
        names = list(self.info.param_names)
        return names[-self.opt.layer_idx:] if self.opt.layer_idx else names

    def client_init(self, client_id, global_state, info):
        state = add_prefix({k: v.clone() for k, v in global_state.items()}, "ala.model.")
        state.update({"ala.w." + k: torch.ones_like(global_state[k]) for k in self._ala_names()})
        state["ala.started"] = torch.zeros((), dtype=reference_tensor(global_state).dtype,
                                           device=reference_tensor(global_state).device)
        return state

    def prepare(self, payload, client_state, data: ClientData):
        local, glob = strip_prefix(client_state, "ala.model."), model_part(payload)
        first = self.info.param_names[0]
        if torch.sum(glob[first] - local[first]) == 0:  # the official deactivation test (round 0)
            return client_state
        names = self._ala_names()
        weights = {k: client_state["ala.w." + k].clone() for k in names}
        start = {**glob, **{k: local[k] for k in local if k not in glob}}  # lower layers: the global model's
        n = len(data.y)
        size = int(self.opt.rand_percent / 100 * n)
        b = self.info.batch_size
        batches = size // b
        if batches == 0:
            return {**client_state, **add_prefix(start, "ala.model.")}
        begin = int(numpy_rng(self.info.seed, "fedala", data.round_idx, data.client_id).integers(0, n - size + 1))
        first_time = float(client_state["ala.started"]) == 0
        losses: list[float] = []
        diff = {k: glob[k] - local[k] for k in names}
        rows = [slice(begin + i * b, begin + (i + 1) * b) for i in range(batches)]
        for _ in range(self.opt.max_start_epochs if first_time else 1):
            weights, loss = ala_epoch(self.info.model_call, start, local, diff, weights,
                                      ((data.x[r], data.y[r]) for r in rows), self.opt.eta)
            losses.append(loss)
            if len(losses) > self.opt.num_pre_loss and np.std(losses[-self.opt.num_pre_loss:]) < self.opt.threshold:
                break
        init = {**start, **{k: (local[k] + diff[k] * weights[k]).detach() for k in names}}
        return {**client_state, **add_prefix(init, "ala.model."), **{"ala.w." + k: v for k, v in weights.items()},
                "ala.started": torch.ones_like(client_state["ala.started"])}

    def local_start(self, payload, client_state):
        return strip_prefix(client_state, "ala.model.")

    def after_training(self, trained, payload, client_state, report):
        return as_model_part(trained), {**client_state, **add_prefix(trained, "ala.model.")}
