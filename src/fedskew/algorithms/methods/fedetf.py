"""fedetf: FedETF (Li et al., ICCV 2023; reference ZexiLee/ICCV-2023-FedETF). (Family ``neural_collapse``; the
class's docstring has the details.)"""

from __future__ import annotations

from pydantic import Field

from fedskew.algorithms.base import (
    FedAvgOptions,
    Method,
    Source,
    add_prefix,
    builtin,
    fraction_steps,
    head_names,
    reference_tensor,
    strip_prefix,
)
from fedskew.algorithms.tensors import balanced_softmax_loss


class FedETFOptions(FedAvgOptions):
    finetune_fraction: float = Field(1.0, ge=0, le=10, description="personalisation: steps fine-tuning the "
                                                                   "projector and temperature, as a multiple of "
                                                                   "the E-epoch step budget (0: none)")


@builtin
class FedETF(Method):
    """FedETF (Li et al., ICCV 2023; reference ZexiLee/ICCV-2023-FedETF). The model's head is a
    trainable linear projector, L2 normalisation, the fixed simplex ETF (shared from the seed, never
    sent) and a learnable temperature beta: logits = beta * M^T normalise(W_p z + b_p)
    (``model.etf_projector``, ``etf_normalize``, ``etf_learn_scale``; beta starts at
    ``model.etf_scale``, 10 by default here as in the reference's CNN). Local training minimises the
    balanced softmax loss with the client's class counts (CE of logits + log n_c; the reference's
    ``balanced_softmax_loss``); body, projector and beta are averaged as in FedAvg (the global
    model). Personalisation (the reference's local fine-tuning, on the locally trained model): CE
    on the projector and beta only, for ``finetune_fraction`` x the E-epoch step budget. Largest
    difference from the reference: it alternates 3 epochs on the ETF matrix itself (lr 0.1) and 3 on
    the projector (lr 0.05), 20 times, once after training; here the ETF stays fixed (a buffer every
    party derives from the seed) and the projector's fine-tuning runs every round at the local lr.

    Sends and keeps what FedAvg does (the ETF is never sent); keeps the fine-tuned projector and
    beta per client."""
    family = "neural_collapse"

    name = "fedetf"
    Options = FedETFOptions
    source = Source(
        authors="Li et al.",
        title="No Fear of Classifier Biases: Neural Collapse Inspired Federated Learning with Synthetic and Fixed "
              "Classifier",
        venue="ICCV",
        year=2023,
        arxiv="2303.10058",
        implements="the projector, the fixed ETF classifier with a learnable temperature, and the local fine-tuning "
                   "(Section 4)",
        code="ZexiLee/ICCV-2023-FedETF")
    requires_classifier = "etf"
    model_defaults = {"classifier": "etf", "etf_projector": True, "etf_normalize": True, "etf_learn_scale": True,
                      "etf_scale": 10.0}
    per_sample_loss = True  # Method.padding_exact
    model_requires = {"classifier.projector.weight": (True, "model.etf_projector = true (its defaults set it; a "
                                                            "config set it to false)")}

    def client_init(self, client_id, global_state, info):
        head = {k: v.clone() for k, v in global_state.items() if k in head_names(self.info)}
        return {**add_prefix(head, "fedetf.p."), "fedetf.counts": info.class_counts[client_id].to(
            reference_tensor(global_state))}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        return balanced_softmax_loss(logits, y, client_state["fedetf.counts"], fwd.cross_entropy), {}

    def split_steps(self, total_steps, lr):
        return total_steps, fraction_steps(total_steps, self.opt.finetune_fraction), lr

    def trained_params(self, stage):
        return head_names(self.info) if stage == "personal" else None

    def after_personal(self, personal, payload, client_state, report):
        return {**client_state, **add_prefix({k: personal[k] for k in head_names(self.info)}, "fedetf.p.")}

    def personal_state(self, trained, client_state):
        if self.opt.finetune_fraction == 0:
            return trained
        return {**trained, **strip_prefix(client_state, "fedetf.p.")}
