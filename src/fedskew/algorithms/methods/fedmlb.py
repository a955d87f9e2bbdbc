"""fedmlb: FedMLB (Kim, Kim and Han, ICML 2022): the local model's blocks also feed the received model's later
blocks (hybrid pathways), whose cross-entropy and divergence from the local output regularise local training.
(Family ``drift``; the class's docstring has the details.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, as_model_part, builtin, model_part, weighted_mean
from fedskew.models.nets import BranchedNet, ModelError

RECEIVED = "received."  # the frozen copy of the received model inside the architecture


class FedMLBOptions(FedAvgOptions):
    search = {"lambda_1": [0.5, 1.0], "lambda_2": [0.5, 1.0]}  # the bench's search space (fedskew bench)
    lambda_1: float = Field(1.0, ge=0, description="weight of the hybrid pathways' cross-entropy (paper Eq. 8)")
    lambda_2: float = Field(1.0, ge=0, description="weight of the hybrid pathways' KL to the main pathway (Eq. 8)")
    temperature: float = Field(1.0, gt=0, description="tau of the KL term's softmaxes")


def multi_level_loss(logits: torch.Tensor, y: torch.Tensor, num_classes: int, lambda_1: float, lambda_2: float,
                     temperature: float, ce=F.cross_entropy, mean=torch.mean) -> tuple[torch.Tensor, dict]:
    """FedMLB's objective from the branched logits [B, (1 + S) C] (main pathway first): CE(main) +
    lambda_1 mean_k CE(hybrid_k) + lambda_2 mean_k KL(softmax(hybrid_k / tau) || softmax(main / tau)),
    the KL per sample averaged over the batch (``nn.KLDivLoss(reduction="batchmean")``), no tau^2,
    neither side detached (the official ``FedMLB.py``)."""
    parts = logits.split(num_classes, 1)
    main, hybrid = parts[0], parts[1:]
    logp = F.log_softmax(main / temperature, 1)
    hce = sum(ce(h, y) for h in hybrid) / len(hybrid)
    kl = sum(mean((torch.xlogy(q, q) - q * logp).sum(1)) for q in (F.softmax(h / temperature, 1) for h in hybrid))
    kl = kl / len(hybrid)
    return ce(main, y) + lambda_1 * hce + lambda_2 * kl, {"fedmlb/hybrid_ce": hce.detach(), "fedmlb/kl": kl.detach()}


@builtin
class FedMLB(Method):
    """FedMLB (Kim, Kim and Han, ICML 2022, "Multi-Level Branched Regularization for Federated
    Learning"). The model is a chain of blocks (``BranchedNet``: the sequential backbone cut after
    each hidden layer of an MLP, each conv stage of a CNN, the stem and each stage of a ResNet; the
    classifier the last block). During local training each block k's output also runs through the
    received global model's later blocks and classifier, frozen (a hybrid pathway; its gradient
    reaches the local blocks), and the local objective is CE(main) + lambda_1 mean_k CE(hybrid_k) +
    lambda_2 mean_k KL(softmax(hybrid_k / tau) || softmax(main / tau)) (``multi_level_loss``; the
    official weights 1, 1 and tau 1). The received model's blocks run in eval mode (the official
    ResNet-18 has GroupNorm and no dropout, where the mode changes nothing). Aggregation and
    communication as FedAvg: the frozen copy is the received model itself and is never sent."""
    family = "drift"

    name = "fedmlb"
    Options = FedMLBOptions
    source = Source(
        authors="Kim, Kim, Han",
        title="Multi-Level Branched Regularization for Federated Learning",
        venue="ICML",
        year=2022,
        arxiv="2207.06936",
        implements="the hybrid pathways and the local objective (Eq. 8)",
        code="jinkyu032/FedMLB (local_update_method/FedMLB.py, models/resnet_FedMLB.py at d695dbf)")
    per_sample_loss = True  # Method.padding_exact

    @classmethod
    def build_model(cls, model, options, rebuild):
        try:
            branched = BranchedNet(model)
        except ModelError as exc:
            raise ValueError(f"method fedmlb needs a model whose backbone is a sequence of layers to branch; {exc}"
                             f"; choose an MLP, a CNN, a VGG or a ResNet.") from None
        if len(branched.blocks) < 1:
            raise ValueError("method fedmlb needs a model with at least one block before its classifier.")
        return branched

    def broadcast(self, global_state, server_state):
        return as_model_part({k: v for k, v in global_state.items() if not k.startswith(RECEIVED)})

    def local_start(self, payload, client_state):
        model = model_part(payload)
        return {**model, **{RECEIVED + k: v for k, v in model.items()}}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        o = self.opt
        return multi_level_loss(logits, y, self.info.num_classes, o.lambda_1, o.lambda_2, o.temperature,
                                fwd.cross_entropy, fwd.mean)

    def after_training(self, trained, payload, client_state, report):
        return as_model_part({k: v for k, v in trained.items() if not k.startswith(RECEIVED)}), client_state

    def aggregate(self, server_state, global_state, uploads, reports):
        new = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        return {**new, **{RECEIVED + k: v for k, v in new.items() if RECEIVED + k in global_state}}, server_state
