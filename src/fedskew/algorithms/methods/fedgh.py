"""fedgh: FedGH (Yi et al., ACM MM 2023): a generalised global header. (Family ``personalized``; the class's
docstring has the details.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import (
    HEAD,
    MODEL,
    ClientReport,
    FedAvgOptions,
    Method,
    Source,
    add_prefix,
    builtin,
    head_names,
    strip_prefix,
)
from fedskew.algorithms.tensors import class_feature_means
from fedskew.streams import torch_seed


class FedGHOptions(FedAvgOptions):
    search = {"server_lr": [0.1, 1.0]}  # the bench's search space (fedskew bench)
    server_lr: float = Field(1.0, gt=0, description="lr of the server's SGD on the global head (PFLlib's "
                                                    "server_learning_rate default)")


def train_head(weight: torch.Tensor, bias: torch.Tensor | None, protos: torch.Tensor, labels: torch.Tensor,
               lr: float, batch_size: int, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FedGH's server step (Yi et al., 2023, Eq. 5; PFLlib ``servergh.train_head``): one pass of
    plain SGD at ``lr`` over the uploaded (prototype, class) pairs in ``order``, batches of
    ``batch_size`` (the last one smaller), each minimising the batch's mean CE of the linear head."""
    w = weight.detach().clone().requires_grad_(True)
    b = None if bias is None else bias.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            logits = protos[idx] @ w.T + (0 if b is None else b)
            gw, *gb = torch.autograd.grad(F.cross_entropy(logits, labels[idx]), [w] + ([] if b is None else [b]))
            with torch.no_grad():
                w -= lr * gw
                if b is not None:
                    b -= lr * gb[0]
    return w.detach(), None if b is None else b.detach()


@builtin
class FedGH(Method):
    """FedGH (Yi et al., ACM MM 2023): a generalised global header. Every client keeps its whole model;
    at the start of a round it takes the server's global head (Eq. 3), trains body and head on CE,
    then uploads the mean eval-mode feature of each class it holds (Eq. 4). The server trains the
    global head by SGD on the uploaded (prototype, class) pairs, one pass in a seeded random order
    (Eq. 5; PFLlib's ``servergh``: server_learning_rate, the clients' batch size). No shared body:
    no global model (``global/*`` none). The personalised model after a round is the locally
    trained one; what PFLlib evaluates (the own body with the latest global head) is the final
    pass's ``personal/final_acc_before``. PFLlib's server head is client 0's head object (the two
    train each other's head); here they are separate."""
    family = "personalized"

    fedavg_weighted = False  # no model aggregated: the head is trained on the prototypes
    name = "fedgh"
    Options = FedGHOptions
    source = Source(authors="Yi, Wang, Liu, Shi, Yu",
                    title="FedGH: Heterogeneous Federated Learning with Generalized Global Header",
                    venue="ACM MM", year=2023, arxiv="2303.13137",
                    implements="Eq. 3-5 (the global header trained on class prototypes)",
                    code="TsingZ0/PFLlib system/flcore/servers/servergh.py, clients/clientgh.py")
    requires_classifier = "linear"
    has_global_model = False
    per_sample_loss = True  # Method.padding_exact

    def server_init(self, global_state, info):
        return {"fedgh.rounds": torch.zeros((), dtype=torch.long)}

    def client_init(self, client_id, global_state, info):
        return {"fedgh.model." + k: v.clone() for k, v in global_state.items()}

    def broadcast(self, global_state, server_state):
        return {MODEL + k: global_state[k] for k in head_names(self.info)}

    def local_start(self, payload, client_state):
        own = strip_prefix(client_state, "fedgh.model.")
        return {**own, **{k: payload[MODEL + k] for k in head_names(self.info)}}

    def after_training(self, trained, payload, client_state, report: ClientReport):
        z, y = report.local_features(trained)
        means, counts = class_feature_means(z, y, self.info.num_classes)
        return {"fedgh.mean": means, "fedgh.count": counts}, add_prefix(trained, "fedgh.model.")

    def aggregate(self, server_state, global_state, uploads, reports):
        protos = torch.cat([u["fedgh.mean"][u["fedgh.count"] > 0] for u in uploads])
        labels = torch.cat([torch.nonzero(u["fedgh.count"] > 0).flatten() for u in uploads])
        rounds = int(server_state["fedgh.rounds"])
        gen = torch.Generator().manual_seed(torch_seed(self.info.seed, "fedgh_order", rounds))
        order = torch.randperm(len(labels), generator=gen).to(labels.device)
        w, b = train_head(global_state[HEAD + "weight"], global_state.get(HEAD + "bias"), protos, labels,
                          self.opt.server_lr, self.info.batch_size, order)
        new = {**global_state, HEAD + "weight": w}
        if b is not None:
            new[HEAD + "bias"] = b
        return new, {"fedgh.rounds": torch.tensor(rounds + 1)}
