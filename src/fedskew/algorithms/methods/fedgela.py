"""fedgela: FedGELA (Fan et al., NeurIPS 2023, "bilateral curation for partially class-disjoint data"; official
code MediaBrain-SJTU/FedGELA ``FedGELA.py``): the fixed simplex ETF M is the global classifier
(``model.classifier=etf``); client k trains with its locally adapted classifier E_w,k * M, logits (z M) * E_w /
T (:func:`gela_scales`: classes it lacks get logit 0) and CE, and its personalised model predicts with E_w * M
(the head of its state scaled, overriding the fixed ETF buffer: ``FederationInfo.fixed_state``). (Family
``neural_collapse``; the class's docstring has the details.)"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin, reference_tensor


def gela_scales(counts: torch.Tensor) -> torch.Tensor:
    """E_w [C] of one client: C n_c / n (0 for a class it lacks), the official ``produce_Ew``."""
    counts = counts.double()
    return (counts.shape[0] * counts / counts.sum()).float()


class FedGELAOptions(FedAvgOptions):
    search = {'gela_temperature': [0.1, 0.2, 0.5]}  # the bench's search space (fedskew bench)
    weighting: Literal["samples", "batches", "uniform"] = Field(
        "batches", description="aggregation weights p_k; batches: the official code's len(dataloader)")
    gela_temperature: float = Field(0.2, gt=0, description="T in the local logits z E_w M / T; 0.2 is the official "
                                                           "argparse default (its README's command uses 1e-5)")


@builtin
class FedGELA(Method):
    """FedGELA (Fan et al., NeurIPS 2023, "bilateral curation for partially class-disjoint data";
    official code MediaBrain-SJTU/FedGELA ``FedGELA.py``): the fixed simplex ETF M is the global
    classifier (``model.classifier=etf``); client k trains with its locally adapted classifier
    E_w,k * M, logits (z M) * E_w / T (:func:`gela_scales`: classes it lacks get logit 0) and CE,
    and its personalised model predicts with E_w * M (the head of its state scaled, overriding the
    fixed ETF buffer: ``FederationInfo.fixed_state``). The global model predicts with M. Keeps
    ``gela.ew`` [C] per client; communication as FedAvg (the head is never sent)."""
    family = "neural_collapse"

    name = "fedgela"
    Options = FedGELAOptions
    # the official train_net clips every step's gradient at norm 20 (FedGELA.py, clip_grad_norm_(..., 20)),
    # whatever the command; where the config leaves grad_clip unset (digits' first gradient norms reach 45)
    run_defaults = {"grad_clip": 20.0}
    source = Source(
        authors="Fan et al.",
        title="Federated Learning with Bilateral Curation for Partially Class-Disjoint Data",
        venue="NeurIPS",
        arxiv="2405.18972", year=2023,
        implements="the global ETF classifier and each client's locally adapted one (the paper's Section 4)",
        code="MediaBrain-SJTU/FedGELA")
    requires_classifier = "etf"
    model_defaults = {"classifier": "etf"}
    per_sample_loss = True  # Method.padding_exact

    def client_init(self, client_id, global_state, info):
        device = reference_tensor(global_state).device
        return {"gela.ew": gela_scales(info.class_counts[client_id]).to(device)}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)
        return fwd.cross_entropy(logits * client_state["gela.ew"] / self.opt.gela_temperature, y), {}

    def personal_state(self, trained, client_state):
        head = self.info.fixed_state["classifier.weight"]  # [C, d]: logits = z @ head^T
        return {**trained, "classifier.weight": client_state["gela.ew"][:, None].to(head) * head.to(
            client_state["gela.ew"].device)}
