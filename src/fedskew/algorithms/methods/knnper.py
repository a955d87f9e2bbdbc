"""knnper: kNN-Per (Marfoq, Neglia, Vidal, Kameni, ICML 2022): FedAvg trains the global model; a client
personalises it at inference by interpolating its output with a kNN distribution over a datastore of its own
training samples' features under that model (:class:`~fedskew.models. (Family ``personalized``; the class's
docstring has the details.)"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, State, as_model_part, builtin, model_part
from fedskew.streams import numpy_rng

STORE = ("knn.keys", "knn.labels", "knn.valid")


class KNNPerOptions(FedAvgOptions):
    search = {"weight": [0.3, 0.5, 0.7], "k": [5, 10]}  # the bench's search space (fedskew bench)
    k: int = Field(5, ge=1, description="neighbours of each test sample in the datastore")
    weight: float = Field(0.5, ge=0, le=1, description="lambda, the weight of the kNN distribution in the "
                                                       "interpolation")
    scale: float = Field(1.0, gt=0, description="kernel width: a neighbour at squared distance d weighs "
                                                "exp(-d / (dim scale))")
    capacity: int = Field(500, ge=1, le=100_000, description="rows of the datastore; a client with more training "
                                                             "samples stores a seeded random subset")
    mix: Literal["probabilities", "logits"] = Field(
        "probabilities", description="interpolate the kNN distribution with the model's probabilities (the paper's "
                                     "Eq. 3) or with its raw logits (FL-bench's evaluate)")


@builtin
class KNNPer(Method):
    """kNN-Per (Marfoq, Neglia, Vidal, Kameni, ICML 2022): FedAvg trains the global model;
    a client personalises it at inference by interpolating its output with a kNN distribution over
    a datastore of its own training samples' features under that model (:class:`~fedskew.models.
    nets.KNNNet`). Before a client's training (``prepare``) its datastore is built with the
    received model, so the round's received model (``personal/acc_before``, and the final pass's
    ``final_acc_before``) is the paper's personalised model; after training it is rebuilt with the
    trained model for ``personal/acc_after``. The uploads carry an empty datastore: the global
    model is FedAvg's alone."""
    family = "personalized"

    @classmethod
    def inert(cls, options, rounds, num_clients, clients_per_round):
        if options.scale < 1e-6:
            return (f"scale = {options.scale:g}: a neighbour at squared distance d weighs exp(-d / (dim scale)), "
                    f"which underflows to 0 for all but identical features, so the kNN part of the output vanishes")

    name = "knnper"
    Options = KNNPerOptions
    source = Source(authors="Marfoq, Neglia, Kameni, Vidal",
                    title="Personalized Federated Learning through Local Memorization",
                    venue="ICML", year=2022, arxiv="2111.09360",
                    implements="Sec. 3 (FedAvg, then the local datastore and Eq. 3's interpolation)",
                    code="KarhouTam/FL-bench src/client/knnper.py, src/server/knnper.py (k 5, weight 0.5, scale 1, "
                         "capacity 500)")
    requires_classifier = "linear"
    per_sample_loss = True  # Method.padding_exact

    @classmethod
    def build_model(cls, model, options, rebuild):
        """The model and an empty datastore of ``capacity`` rows."""
        from fedskew.models.nets import KNNNet

        o = options
        return KNNNet(model, o.capacity, o.k, o.weight, o.scale, o.mix)

    def datastore(self, z: torch.Tensor, y: torch.Tensor, like: State, client_id: int) -> State:
        """The ``knn.*`` buffers holding (z, y): every sample, or ``capacity`` of them drawn from the
        seed and the client (the same rows every time)."""
        cap = like["knn.valid"].shape[0]
        rows = torch.arange(len(y))
        if len(y) > cap:
            rows = torch.from_numpy(numpy_rng(self.info.seed, "knnper", client_id).choice(len(y), cap, replace=False))
        keys, labels, valid = (torch.zeros_like(like[k]) for k in STORE)
        keys[:len(rows)] = z[rows].to(keys)
        labels[torch.arange(len(rows)), y[rows].long()] = 1
        valid[:len(rows)] = 1
        return {"knn.keys": keys, "knn.labels": labels, "knn.valid": valid}

    def prepare(self, payload, client_state, data):
        glob = model_part(payload)
        z, _ = data.frozen(glob, data.x)
        return {**client_state, **self.datastore(z, data.y, glob, data.client_id)}

    def local_start(self, payload, client_state):
        return {**model_part(payload), **{k: client_state[k] for k in STORE if k in client_state}}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        """FedAvg's loss on the model's own logits (the datastore serves inference only)."""
        z, _ = fwd(x)
        return fwd.cross_entropy(fwd.head(z), y), {}

    def after_training(self, trained, payload, client_state, report):
        empty = {k: torch.zeros_like(trained[k]) for k in STORE}
        z, y = report.local_features(trained)
        return as_model_part({**trained, **empty}), self.datastore(z, y, trained, report.client_id)

    def personal_state(self, trained, client_state):
        return {**trained, **{k: client_state[k] for k in STORE if k in client_state}}
