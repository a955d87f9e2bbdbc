"""fedas: FedAS (Yang et al., CVPR 2024, "FedAS: Bridging Inconsistency in Personalized Federated Learning";
reference PFLlib's ``clientas.py`` and ``serveras.py``). (Family ``sharing``; the class's docstring has the
details.)"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import (
    ClientData,
    FedAvgOptions,
    Method,
    Source,
    State,
    add_prefix,
    as_model_part,
    body_names,
    builtin,
    model_part,
    reference_tensor,
    strip_prefix,
    weighted_mean,
)
from fedskew.algorithms.tensors import class_feature_means
from fedskew.streams import numpy_rng


class FedASOptions(FedAvgOptions):
    search = {"align_lr": [0.001, 0.01, 0.1]}  # the bench's search space (fedskew bench)
    align_lr: float = Field(0.01, ge=0, description="SGD learning rate of the parameter alignment (the official 0.01)")
    align_epochs: int = Field(1, ge=0, description="epochs of the alignment over the client's data (the official 1)")
    align_batch_size: int = Field(16, ge=1, description="batch size of the prototypes and of the alignment (the "
                                                        "official 16)")
    align_target: Literal["samples", "class_mean"] = Field(
        "samples", description="samples: MSE of every sample's feature to its class prototype (PFLlib's clientas, the "
                               "authors' code); class_mean: MSE of the batch's class-mean feature (FL-bench's fedas)")


@builtin
class FedAS(Method):
    """FedAS (Yang et al., CVPR 2024, "FedAS: Bridging Inconsistency in Personalized Federated
    Learning"; reference PFLlib's ``clientas.py`` and ``serveras.py``). Each client keeps its own
    model; the body is replaced every round, the head (``classifier.*``) stays the client's.

    Parameter alignment (before local training, on the client): the class prototypes of its own
    model's body over its training data (eval mode, no gradient) are the targets; the received
    global body is trained to them by plain SGD (``align_lr``, no momentum, ``align_epochs``
    passes over the data in full batches of ``align_batch_size`` in a seeded order) on
    sum_{c in batch} MSE(z_global(x_{y=c}), prototype_c), and the aligned body replaces the
    client's (parameters; its buffers stay). Then E epochs of CE on the whole model, which is the
    personalised model and is uploaded whole. Client synchronisation (after training): the trace
    of the empirical Fisher information, sum over the full batches of B (stored order, eval mode) of
    ||grad_theta mean_batch NLL||^2 over all parameters, is uploaded with the model, and the
    server's model is the trace-weighted mean of the uploads, F_k / sum F (parameters and
    buffers; the official code keeps the first upload's buffers). The official code also computes
    the trace of every unselected client each round, for its log only: not done here.

    No global model is scored: the server's model is a by-product whose body every client
    receives and whose head (the trace-weighted mean of the clients' heads) no client uses (the
    official code evaluates the personalised models only).

    Down: the model. Up: the model + 1 float. Keeps: its own model (client)."""
    family = "sharing"

    fedavg_weighted = False  # Fisher-trace weights (Method.fedavg_weighted)

    name = "fedas"
    Options = FedASOptions
    source = Source(
        authors="Yang et al.",
        title="FedAS: Bridging Inconsistency in Personalized Federated Learning",
        venue="CVPR",
        year=2024,
        implements="parameter alignment and Fisher-weighted aggregation (the paper's Section 4)",
        code="PFLlib's clientas.py and serveras.py (no official code found)")
    has_global_model = False  # the Fisher-weighted mean's head is nobody's: its body is what clients use
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss)

    def client_init(self, client_id, global_state, info):
        return add_prefix({k: v.clone() for k, v in global_state.items()}, "as.model.")

    def prepare(self, payload, client_state, data: ClientData):
        own, glob = strip_prefix(client_state, "as.model."), model_part(payload)
        body = sorted(body_names(self.info))
        rng = numpy_rng(self.info.seed, "fedas_align", data.round_idx, data.client_id)
        protos = own_prototypes(data.frozen, own, data.x, data.y, self.opt.align_batch_size)
        aligned = align_body(self.info.model_call, glob, body, protos, data.x, data.y, self.opt.align_lr,
                             self.opt.align_epochs, self.opt.align_batch_size, rng, self.opt.align_target)
        return {**client_state, **add_prefix({**own, **aligned}, "as.model.")}

    def local_start(self, payload, client_state):
        return strip_prefix(client_state, "as.model.")

    def after_training(self, trained, payload, client_state, report):
        x, y = report.local_data()
        fim = fisher_trace(self.info.model_call, trained, self.info.param_names, x, y, self.info.batch_size)
        ref = reference_tensor(trained)
        return ({**as_model_part(trained), "as.fim": torch.tensor(fim, dtype=ref.dtype, device=ref.device)},
                add_prefix(trained, "as.model."))

    def aggregate(self, server_state, global_state, uploads, reports):
        fim = torch.stack([u["as.fim"].double() for u in uploads])
        w = fim / fim.sum() if fim.sum() > 0 else torch.full_like(fim, 1 / len(fim))  # (all zero: uniform)
        return weighted_mean([model_part(u) for u in uploads], w), server_state


def own_prototypes(frozen, state: State, x: torch.Tensor, y: torch.Tensor, batch: int) -> dict[int, torch.Tensor]:
    """FedAS's targets: each class's mean feature of the client's own model over its data (eval mode)."""
    z = torch.cat([frozen(state, x[i:i + batch])[0] for i in range(0, len(x), batch)])
    means, counts = class_feature_means(z, y, int(y.max()) + 1)
    return {c: means[c] for c in range(len(counts)) if counts[c] > 0}


def align_body(model_call, glob: State, body: list[str], protos: dict[int, torch.Tensor], x: torch.Tensor,
               y: torch.Tensor, lr: float, epochs: int, batch: int, rng, target: str = "samples") -> State:
    """FedAS's parameter alignment: plain SGD on the global model's body parameters ``body`` of
    sum_{c in batch} MSE(z(x_c), protos[c]) (the mean over the class's rows and features; with
    ``target="class_mean"`` of the class's mean feature), train-mode forward, ``epochs`` passes in
    full batches of ``batch`` (order from ``rng``). Returns the body."""
    params = {k: glob[k].detach().clone() for k in body}
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(len(y))).to(y.device)
        for part in full_batches(len(y), batch):
            rows = order[part]
            xb, yb = x[rows], y[rows]
            live = {k: v.requires_grad_(True) for k, v in params.items()}
            z, _ = model_call({**glob, **live}, xb, True)
            feats = [(z[yb == c].mean(0, keepdim=True) if target == "class_mean" else z[yb == c], protos[int(c)])
                     for c in torch.unique(yb)]
            loss = sum(F.mse_loss(f, p.expand_as(f)) for f, p in feats)
            grads = torch.autograd.grad(loss, [live[k] for k in body])
            params = {k: (live[k] - lr * g).detach() for k, g in zip(body, grads)}
    return params


def full_batches(n: int, batch: int) -> list[slice]:
    """The official loaders' batches (``drop_last=True``): full batches only; all rows when fewer."""
    return [slice(i, i + batch) for i in range(0, n - batch + 1, batch)] or [slice(0, n)]


def fisher_trace(model_call, state: State, names, x: torch.Tensor, y: torch.Tensor, batch: int) -> float:
    """FedAS's client weight (client synchronisation): sum over the full batches of the data, in
    its stored order, of ||grad_theta mean_batch(-log softmax(f(x))_y)||^2 over the parameters
    ``names``, eval mode (the trace of the empirical Fisher information as the official code sums
    it, over a shuffled ``drop_last`` loader)."""
    names = list(names)
    total = 0.0
    for rows in full_batches(len(y), batch):
        live = {k: state[k].detach().clone().requires_grad_(True) for k in names}
        _, logits = model_call({**state, **live}, x[rows], False)
        nll = -F.log_softmax(logits, dim=1).gather(1, y[rows][:, None]).mean()
        total += sum(float(g.double().pow(2).sum()) for g in torch.autograd.grad(nll, [live[k] for k in names]))
    return total
