"""fedka: L = CE(batch) + beta * knowledge-anchor loss on every mini-batch. (Family ``fedka``; the class's
docstring has the details.)"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import ClientData, FedAvgOptions, Method, Source, builtin, model_part, reference_tensor
from fedskew.metrics import class_roles
from fedskew.streams import numpy_rng


def anchor_indices(roles: torch.Tensor, y_local: np.ndarray, losses: np.ndarray | None, cap: int,
                   strategy: str, rng: np.random.Generator) -> list[tuple[str, int]]:
    """The anchor set of one client for one round: ("public", c) for each missing class c (the
    shared sample), ("local", i) for one local sample of each non-dominant class (random, or the
    largest / smallest loss under the received global model for ``hard`` / ``proficient``); a
    random subset of ``cap`` when more."""
    anchors: list[tuple[str, int]] = []
    for c in range(len(roles)):
        if roles[c] == 0:
            anchors.append(("public", c))
        elif roles[c] == 1:
            pool = np.flatnonzero(y_local == c)
            if strategy == "random":
                anchors.append(("local", int(rng.choice(pool))))
            else:
                order = np.argsort(losses[pool], kind="stable")
                anchors.append(("local", int(pool[order[-1] if strategy == "hard" else order[0]])))
    if len(anchors) > cap:
        keep = np.sort(rng.choice(len(anchors), size=cap, replace=False))
        anchors = [anchors[i] for i in keep]
    return anchors


def knowledge_anchor_loss(local_logits: torch.Tensor, global_logits: torch.Tensor, keep_classes: torch.Tensor,
                          valid: torch.Tensor) -> torch.Tensor:
    """(1/|T|) sum_{t in T} || Phi(f_global(t)) - Phi(f_local(t)) ||_2^2, Phi keeping the logits of
    missing and non-dominant classes (``keep_classes``); ``valid`` masks padding rows of T. Zero
    when T is empty."""
    diff = (global_logits - local_logits) * keep_classes.to(local_logits.dtype)
    per_anchor = diff.pow(2).sum(-1) * valid.to(local_logits.dtype)
    return per_anchor.sum() / valid.to(local_logits.dtype).sum().clamp(min=1)


class FedKAOptions(FedAvgOptions):
    search = {'ka_beta': [0.001, 0.01, 0.1]}  # the bench's search space (fedskew bench)
    ka_beta: float = Field(0.001, ge=0, description="weight of the knowledge-anchor term (paper grid 0.5, 0.1, "
                                                    "0.01, 0.001; 0.1 and 0.01 blow up or lag: docs/methods.md)")
    gamma: float | None = Field(None, gt=0, le=1, description="non-dominant threshold on the class share "
                                                              "(default 1/C)")
    anchor_cap: int = Field(10, ge=1, description="most anchors per client")
    anchor_strategy: Literal["random", "hard", "proficient"] = Field("random", description=
        "which own sample anchors a non-dominant class: random (the paper), or the one with the largest (hard) "
        "/ smallest (proficient) loss under the received global model")


@builtin
class FedKA(Method):
    """L = CE(batch) + beta * knowledge-anchor loss on every mini-batch.

    Before each round's local training the client rebuilds its anchor set (``prepare``): the
    public sample of each missing class (``FederationInfo.public_samples``: one training sample per
    class drawn once from the seed and, as the paper assumes, visible to every client) and one of
    its own samples of each non-dominant class, redrawn every round (stream ``fedka_anchors``),
    capped. The received global model's logits on the anchors are computed once then.

    Keeps per client (rebuilt each round, padded to ``anchor_cap``): anchors, their global logits,
    a validity mask and the kept-class mask. Communication as FedAvg. The anchors pass through the
    model being trained in eval mode (``fwd.evaluate``), the mode of the global logits they are
    compared with: in train mode, the zero padding of the anchor set would enter BatchNorm's batch
    statistics and shift the real anchors' logits (the loss was 0.41 where local = global), and the
    anchors would move the running statistics."""
    family = "fedka"

    name = "fedka"
    Options = FedKAOptions
    source = Source(
        authors="Chen, Zhu, Zheng",
        title="Towards Fast and Stable Federated Learning: Confronting Heterogeneity via Knowledge Anchor",
        venue="arXiv preprint",
        year=2023,
        arxiv="2312.02416",
        implements="Eq. 1 (forgetting degree), Eq. 2 (knowledge anchors) and Eq. 3 (the local objective), Algorithm "
                   "1",
        code="no official code found; the paper's text")
    per_sample_loss = True  # CE per sample; the anchor term does not depend on the batch

    def __init__(self, options=None, info=None):
        super().__init__(options, info)
        if info is not None and info.public_samples is None:
            missing = torch.flatnonzero(info.class_counts.sum(0) == 0).tolist()
            raise ValueError(f"method fedka needs one training sample of every class for its public anchors; "
                             f"the training split has none of classes {missing[:10]}.")

    def class_role_threshold(self, num_classes: int) -> float:
        return self.opt.gamma if self.opt.gamma is not None else 1.0 / num_classes

    def _gamma(self) -> float:
        return self.class_role_threshold(self.info.num_classes)

    def client_init(self, client_id, global_state, info):
        ref = reference_tensor(global_state)
        x_pub, _ = info.public_samples
        cap, C = self.opt.anchor_cap, info.num_classes
        roles = class_roles(info.class_counts[client_id], self._gamma())
        return {"ka.x": torch.zeros(cap, *x_pub.shape[1:], dtype=x_pub.dtype, device=ref.device),
                "ka.global_logits": torch.zeros(cap, C, dtype=ref.dtype, device=ref.device),
                "ka.valid": torch.zeros(cap, dtype=ref.dtype, device=ref.device),
                "ka.keep": (roles < 2).to(device=ref.device, dtype=ref.dtype)}

    def prepare(self, payload, client_state, data: ClientData):
        x_pub, _ = self.info.public_samples
        roles = class_roles(self.info.class_counts[data.client_id], self._gamma())
        global_state = model_part(payload)
        losses = None
        if self.opt.anchor_strategy != "random":
            _, logits = data.frozen(global_state, data.x)
            losses = F.cross_entropy(logits, data.y, reduction="none").cpu().numpy()
        rng = numpy_rng(self.info.seed, "fedka_anchors", data.round_idx, data.client_id)
        anchors = anchor_indices(roles, data.y.cpu().numpy(), losses, self.opt.anchor_cap,
                                 self.opt.anchor_strategy, rng)
        x = torch.zeros_like(client_state["ka.x"])
        valid = torch.zeros_like(client_state["ka.valid"])
        for i, (source, j) in enumerate(anchors):
            x[i] = x_pub[j] if source == "public" else data.x[j]
            valid[i] = 1.0
        _, global_logits = data.frozen(global_state, x)
        return {**client_state, "ka.x": x, "ka.valid": valid, "ka.global_logits": global_logits}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        # anchors first: the batch's train-mode pass below moves BatchNorm's running statistics
        _, anchor_logits = fwd.evaluate(client_state["ka.x"])
        _, logits = fwd(x)
        ce = fwd.cross_entropy(logits, y)
        ka = knowledge_anchor_loss(anchor_logits, client_state["ka.global_logits"], client_state["ka.keep"],
                                   client_state["ka.valid"])
        return ce + self.opt.ka_beta * ka, {"fedka/anchor": ka.detach()}
