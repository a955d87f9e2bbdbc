"""fedbabu: FedBABU (Oh et al., ICLR 2022). (Family ``personalized``; the class's docstring has the details.)"""

from __future__ import annotations

from pydantic import Field

from fedskew.algorithms.base import (
    HEAD,
    FedAvgOptions,
    Method,
    Source,
    add_prefix,
    as_model_part,
    body_names,
    builtin,
    fraction_steps,
    model_part,
    strip_prefix,
    weighted_mean,
)


class FedBABUOptions(FedAvgOptions):
    search = {'finetune_fraction': [0.5, 1.0]}  # the bench's search space (fedskew bench)
    finetune_fraction: float = Field(1.0, gt=0, le=10, description="fine-tuning steps, as a multiple of the "
                                                                   "E-epoch step budget")


@builtin
class FedBABU(Method):
    """FedBABU (Oh et al., ICLR 2022). During federated training the head stays at its random
    initialisation (never trained, never sent up); clients train and upload the body only. The
    personalised model is the received global model fine-tuned on local data, body and head,
    for ``finetune_fraction`` x the E-epoch step budget at the same learning rate (paper Section
    4: fine-tuning the whole model). The global model is the body with the fixed head.

    Down: the full model; up: the body. Keeps the latest fine-tuned model per client."""
    family = "personalized"

    name = "fedbabu"
    Options = FedBABUOptions
    source = Source(
        authors="Oh, Kim, Yun",
        title="FedBABU: Towards Enhanced Representation for Federated Image Classification",
        venue="ICLR",
        year=2022,
        arxiv="2106.06042",
        implements="Algorithm 1 (body-only training and aggregation, head fine-tuned for personalisation)",
        code="jhoon-oh/FedBABU")
    requires_classifier = "linear"

    def client_init(self, client_id, global_state, info):
        # the latest personalised model (same keys for every client, so clients stack)
        return add_prefix({k: v.clone() for k, v in global_state.items()}, "babu.")

    def split_steps(self, total_steps, lr):
        return total_steps, fraction_steps(total_steps, self.opt.finetune_fraction), lr

    def trained_params(self, stage):
        return None if stage == "personal" else body_names(self.info)

    def after_training(self, trained, payload, client_state, report):
        return as_model_part({k: v for k, v in trained.items() if not k.startswith(HEAD)}), client_state

    def personal_start(self, trained, payload, client_state):
        return model_part(payload)

    def after_personal(self, personal, payload, client_state, report):
        return add_prefix(personal, "babu.")

    def personal_state(self, trained, client_state):
        return strip_prefix(client_state, "babu.")

    def aggregate(self, server_state, global_state, uploads, reports):
        body = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        return {**global_state, **body}, server_state
