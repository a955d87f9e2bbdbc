"""fedah: FedAH (Zhou et al., arXiv 2024; as FL-bench's ``fedah`` runs it): FedALA's adaptive local aggregation
(:func:`ala_epoch`) applied to the head. (Family ``sharing``; the class's docstring has the details.)"""

from __future__ import annotations

import torch
from pydantic import Field

from fedskew.algorithms.base import (
    ClientData,
    FedAvgOptions,
    Method,
    Source,
    add_prefix,
    body_names,
    builtin,
    head_names,
    model_part,
    strip_prefix,
)
from fedskew.algorithms.sharing import ala_epoch
from fedskew.streams import numpy_rng


class FedAHOptions(FedAvgOptions):
    search = {"eta": [0.1, 1.0], "head_epochs": [1, 2]}  # the bench's search space (fedskew bench)
    eta: float = Field(1.0, gt=0, description="learning rate of the head's aggregation weights")
    head_epochs: int = Field(1, ge=1, le=10_000, description="epochs of the weight learning and of the head's training "
                                                  "(FL-bench's plocal_epochs)")


@builtin
class FedAH(Method):
    """FedAH (Zhou et al., arXiv 2024; as FL-bench's ``fedah`` runs it): FedALA's adaptive local aggregation
    (:func:`ala_epoch`) applied to the head. Before training, a client mixes its own head theta
    (kept from its last round) with the received global head theta_g element-wise,
    theta + (theta_g - theta) * W, W in [0, 1] learned per batch over ``head_epochs`` passes of its
    data with the received body (``prepare``; W kept across rounds, initially ones). Then it trains
    the head for ``head_epochs`` epochs with the body frozen, then the body for its E epochs with the
    head frozen (``personal_first``). The whole model is uploaded and averaged as FedAvg's; the
    client keeps its trained head."""
    family = "sharing"

    name = "fedah"
    Options = FedAHOptions
    source = Source(
        authors="Zhou, He, Zhai, Gao, Chen, Qin, Zhang, Guo",
        title="FedAH: Aggregated Head for Personalized Federated Learning",
        venue="arXiv preprint",
        year=2024,
        arxiv="2412.01295",
        implements="head aggregation by learned element-wise weights, then head and body training",
        code="KarhouTam/FL-bench src/client/fedah.py, src/server/fedah.py (eta 1.0, plocal_epochs 1); "
        "the authors' code is heyuepeng/FedAH",
    )
    requires_classifier = "linear"
    personal_first = True
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss, both stages)

    def client_init(self, client_id, global_state, info):
        heads = head_names(info)
        return {**{"ah.head." + k: global_state[k].clone() for k in heads},
                **{"ah.w." + k: torch.ones_like(global_state[k]) for k in heads}}

    def prepare(self, payload, client_state, data: ClientData):
        glob, heads = model_part(payload), sorted(head_names(self.info))
        local = {k: client_state["ah.head." + k] for k in heads}
        diff = {k: glob[k] - local[k] for k in heads}
        weights = {k: client_state["ah.w." + k] for k in heads}
        b, n = self.info.batch_size, len(data.y)
        for epoch in range(self.opt.head_epochs):
            order = torch.from_numpy(numpy_rng(self.info.seed, "fedah", data.round_idx, data.client_id, epoch)
                                     .permutation(n))
            batches = ((data.x[order[i:i + b]], data.y[order[i:i + b]]) for i in range(0, n, b))
            weights, _ = ala_epoch(self.info.model_call, glob, local, diff, weights, batches, self.opt.eta)
        mixed = {k: (local[k] + diff[k] * weights[k]).detach() for k in heads}
        return {**client_state, **add_prefix(mixed, "ah.head."), **add_prefix(weights, "ah.w.")}

    def local_start(self, payload, client_state):
        return {**model_part(payload), **strip_prefix(client_state, "ah.head.")}

    def split_steps(self, total_steps, lr):
        head = max(1, round(total_steps * self.opt.head_epochs / max(self.info.local_epochs, 1)))
        return total_steps, head, lr

    def trained_params(self, stage):
        return head_names(self.info) if stage == "personal" else body_names(self.info)

    def after_personal(self, personal, payload, client_state, report):
        return {**client_state, **add_prefix({k: personal[k] for k in head_names(self.info)}, "ah.head.")}
