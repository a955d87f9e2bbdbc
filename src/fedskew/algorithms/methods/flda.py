"""flda: FLDA, federated learning with domain adaptation (Peterson, Kanani and Marathe, 2019), in the form of the
MAP authors' code (the implementation behind MAP Table II): each client mixes the global model's logits with
those of a private model of the same architecture through a gate on the global model's features, logits =
alpha(z) g(x) + (1 - alpha(z)) p_k(x) with alpha(z) = sigmoid(w_k^T z + b_k) (``FLDA.build_model``,
:class:`PrivateExpertNet`), and trains the three jointly on the mixture's cross-entropy (``loss=code``: counted
twice, see the option; ``loss=both`` adds the global model's own cross-entropy, so that g also learns as a
classifier by itself rather than only through alpha). (Family ``sharing``; the class's docstring has the
details.)"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Source, builtin
from fedskew.algorithms.compose import PartialSharing
from fedskew.models.nets import PrivateExpertNet


class FLDAOptions(FedAvgOptions):
    loss: Literal["code", "single", "both"] = Field(
        "code",
        description="code: CE of the mixture counted twice, as the MAP authors' FLDANet returns it as both "
        "of its outputs (their MAP Table II runs); single: CE of the mixture once; both: CE of the "
        "mixture + CE of the global model's own logits (the two-output form of that code's template)",
    )


@builtin
class FLDA(PartialSharing):
    """FLDA, federated learning with domain adaptation (Peterson, Kanani and Marathe, 2019), in the
    form of the MAP authors' code (the implementation behind MAP Table II): each client mixes the global model's logits
    with those of a private model of the same architecture through a gate on the global model's features, logits =
    alpha(z) g(x) + (1 - alpha(z)) p_k(x) with alpha(z) = sigmoid(w_k^T z + b_k) (``FLDA.build_model``,
    :class:`PrivateExpertNet`), and trains the three jointly on the mixture's cross-entropy (``loss=code``: counted
    twice, see the option; ``loss=both`` adds the global model's own cross-entropy, so that g also learns as a
    classifier by itself rather than only through alpha). Only the global model is sent and averaged (FedAvg weights);
    the private model and the gate stay on the client (the private model starts from its own initialisation, the same
    for every client). Personalised model: the mixture; global model: the averaged g alone. The MAP code tests the
    personalised model on 0.5 (softmax + softmax) of the mixture, the same argmax.

    Sends what FedAvg does; keeps a second model and d + 1 gate weights per client."""
    family = "sharing"

    name = "flda"
    Options = FLDAOptions
    source = Source(
        authors="Peterson, Kanani, Marathe",
        title="Private Federated Learning with Domain Adaptation",
        venue="NeurIPS 2019 workshop on federated learning",
        arxiv="1912.06733", year=2019,
        implements="the gated mixture of the global and a private model",
        code="lxcnju/FedRepo (the MAP authors' FLDA, the implementation behind MAP Table II)")
    keep = "flda."
    per_sample_loss = True  # Method.padding_exact

    @classmethod
    def build_model(cls, model, options, rebuild):
        """A private model of the same configuration (drawn next) and the gate mixing the two
        models' logits (:class:`~fedskew.models.nets.PrivateExpertNet`); both stay on the clients."""
        return PrivateExpertNet(model, rebuild())

    def shared(self, key):
        return not key.startswith(("private.", "gate"))

    def client_init(self, client_id, global_state, info):
        state = super().client_init(client_id, global_state, info)
        return {**state, self.keep + "gate_on": torch.ones_like(state[self.keep + "gate_on"])}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, logits = fwd(x)  # the mixture (the client's gate is on)
        ce = fwd.cross_entropy(logits, y)
        if self.opt.loss == "single":
            return ce, {}
        if self.opt.loss == "code":
            return 2 * ce, {}
        own = fwd.cross_entropy(fwd.head(z), y)  # the global model's classifier on its own features
        return ce + own, {"flda/global_ce": own.detach()}
