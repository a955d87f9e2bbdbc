"""fedrod: FedROD (Chen & Chao, ICLR 2022). (Family ``personalized``; the class's docstring has the details.)"""

from __future__ import annotations

import torch

from fedskew.algorithms.base import (
    HEAD,
    FedAvgOptions,
    Method,
    Source,
    as_model_part,
    builtin,
    head_names,
    reference_tensor,
)
from fedskew.algorithms.tensors import balanced_softmax_loss


@builtin
class FedROD(Method):
    """FedROD (Chen & Chao, ICLR 2022). Shared body + generic head trained with the balanced
    softmax on the client's label counts (uploaded, FedAvg-aggregated: the global model); a
    personal head W_p on the client, its prediction the sum of both heads' logits:
    (W_g + W_p) z (+ b_g + b_p).

    The personal head trains on the generic model's features with plain CE of the summed logits,
    body and generic head frozen. Because the summed logits are linear in W_g + W_p, this is SGD
    on the combined head started from W_g + W_p with only the classifier trainable, and
    W_p = combined - W_g after it. Schedule: it runs after the body's update for the same number of
    steps (the reference interleaves one personal-head step per body step on the current
    features; here every step sees the round's final body). Weight decay, if set, applies to the
    combined head rather than W_p alone. W_p starts at 0 (the personalised model starts as the
    generic one).

    Down/up: the full model (FedAvg); keeps W_p and the round's W_g per client."""
    family = "personalized"

    name = "fedrod"
    Options = FedAvgOptions
    source = Source(
        authors="Chen, Chao",
        title="On Bridging Generic and Personalized Federated Learning for Image Classification",
        venue="ICLR",
        year=2022,
        arxiv="2107.00778",
        implements="Eq. 3 (balanced softmax for the generic head) and the personal head (Section 4)",
        code="hongyouc/Fed-RoD")
    per_sample_loss = True  # Method.padding_exact
    requires_classifier = "linear"

    def client_init(self, client_id, global_state, info):
        state = {"rod.p." + k: torch.zeros_like(v) for k, v in global_state.items() if k.startswith(HEAD)}
        state.update({"rod.g." + k: v.clone() for k, v in global_state.items() if k.startswith(HEAD)})
        state["rod.counts"] = info.class_counts[client_id].to(reference_tensor(global_state))
        return state

    def local_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        return balanced_softmax_loss(logits, y, client_state["rod.counts"], fwd.cross_entropy), {}

    def after_training(self, trained, payload, client_state, report):
        state = {**client_state, **{"rod.g." + k: v for k, v in trained.items() if k.startswith(HEAD)}}
        return as_model_part(trained), state

    def split_steps(self, total_steps, lr):
        return total_steps, total_steps, lr

    def trained_params(self, stage):
        return head_names(self.info) if stage == "personal" else None

    def personal_start(self, trained, payload, client_state):
        return self.personal_state(trained, client_state)

    def after_personal(self, personal, payload, client_state, report):
        new = {"rod.p." + k: v - client_state["rod.g." + k] for k, v in personal.items() if k.startswith(HEAD)}
        return {**client_state, **new}

    def personal_state(self, trained, client_state):
        return {k: v + client_state["rod.p." + k] if k.startswith(HEAD) else v for k, v in trained.items()}
