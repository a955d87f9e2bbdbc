"""feddf: FedDF (Lin et al., NeurIPS 2020, Algorithm 1). (Family ``distillation``; the class's docstring has the
details.)"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin, model_part, reference_tensor, weighted_mean
from fedskew.streams import torch_seed


class FedDFOptions(FedAvgOptions):
    search = {'temperature': [1.0, 3.0], 'distill_lr': [0.0001, 0.001]}  # the bench's search space (fedskew bench)
    public_size: int = Field(500, ge=1, description="unlabelled public samples (MAP Tables I/II: 500 of the "
                                                    "global test set)")
    public_source: Literal["train", "validation", "test_images"] = Field(
        "train", description="train: inputs of the pooled training set (default); validation: the global "
                             "validation hold-out (dataset.validation_fraction > 0), disjoint from every client's "
                             "data; test_images: the global test set's images, the MAP paper's protocol, where "
                             "test data reaches training (at most half of it; never for model selection)")

    @field_validator("public_source", mode="before")
    @classmethod
    def _former_test(cls, value):
        if value == "test":
            warnings.warn("feddf public_source 'test' is now called 'test_images' (the MAP paper's protocol, in which "
                          "test images reach training); the old name works until fedskew 0.2.", FutureWarning,
                          stacklevel=2)
            return "test_images"
        return value
    distill_steps: int = Field(500, ge=0, description="server distillation steps per round (official code: up "
                                                      "to 10,000 with early stopping on a validation set)")
    distill_lr: float = Field(1e-3, gt=0, description="Adam learning rate of the distillation (paper Section 4)")
    distill_batch: int = Field(64, ge=1, description="unlabelled samples per server distillation step")
    temperature: float = Field(1.0, gt=0, description="softmax temperature of teacher and student")


def ensemble_distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                               temperature: float) -> torch.Tensor:
    """FedDF Eq. (Algorithm 1, line 8): KL(softmax(teacher/T) || softmax(student/T)), batch mean,
    with the teacher the average of the clients' logits (AVGLOGITS)."""
    return F.kl_div(F.log_softmax(student_logits / temperature, -1), F.softmax(teacher_logits / temperature, -1),
                    reduction="batchmean")


@builtin
class FedDF(Method):
    """FedDF (Lin et al., NeurIPS 2020, Algorithm 1). Clients train as in FedAvg; the server
    initialises the new global model as the weighted average of the uploads, then distils the
    ensemble of the uploaded models into it on unlabelled public data: ``distill_steps`` Adam steps
    on mini-batches of the public set, each minimising the KL divergence between the softmax of
    the average of the client models' logits (teachers in eval mode) and the student's (train
    mode; its BatchNorm running statistics stay the averaged ones). The public set:
    ``public_size`` inputs drawn once from the seed, labels never read, from the pooled training
    set (default: no test data reaches training), the global validation hold-out, or, behind
    ``public_source=test_images``, the global test set (the MAP paper's 500 test images; at most
    half of it, digits' 359 test images give 179). Without a validation set there is no early
    stopping: a fixed number of steps (documented difference).

    Sends and keeps what FedAvg does; the server holds the public set."""
    family = "distillation"

    name = "feddf"
    Options = FedDFOptions
    source = Source(
        authors="Lin, Kong, Stich, Jaggi",
        title="Ensemble Distillation for Robust Model Fusion in Federated Learning",
        venue="NeurIPS",
        year=2020,
        arxiv="2006.07242",
        implements="Algorithm 1 (ensemble distillation on an unlabelled public set)",
        code="no official code; the paper's Algorithm 1")
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss)

    def __init__(self, options=None, info=None):
        super().__init__(options, info)
        if info is not None and info.public_pool is not None:
            self.public()  # a source this federation lacks is refused now, in one sentence

    def public(self) -> torch.Tensor:
        """The public set: the first ``public_size`` of the seeded pool (of the test images at most half)."""
        source = {"test_images": "test"}.get(self.opt.public_source, self.opt.public_source)
        pool = self.info.public_pool(source)
        return pool[:min(self.opt.public_size, len(pool) // 2 if source == "test" else len(pool))]

    def server_init(self, global_state, info):
        return {"feddf.round": torch.zeros((), device=reference_tensor(global_state).device)}

    def distill(self, student: dict, teachers: list[dict], round_idx: int) -> dict:
        x = self.public()
        call = self.info.model_call
        with torch.no_grad():
            teacher = torch.stack([call(t, x)[1] for t in teachers]).mean(0)
        names = [k for k in self.info.param_names if k in student]
        params = {k: student[k].detach().clone().requires_grad_(True) for k in names}
        buffers = {k: v for k, v in student.items() if k not in params}
        opt = torch.optim.Adam(params.values(), lr=self.opt.distill_lr)
        gen = torch.Generator().manual_seed(torch_seed(self.info.seed, "feddf", round_idx))
        order = torch.empty(0, dtype=torch.long)
        for _ in range(self.opt.distill_steps):
            if len(order) < min(self.opt.distill_batch, len(x)):
                order = torch.cat([order, torch.randperm(len(x), generator=gen)])
            rows, order = order[:self.opt.distill_batch].to(x.device), order[self.opt.distill_batch:]
            _, logits = call({**params, **buffers}, x[rows], True)
            loss = ensemble_distillation_loss(logits, teacher[rows], self.opt.temperature)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return {**student, **{k: v.detach() for k, v in params.items()}}

    def aggregate(self, server_state, global_state, uploads, reports):
        models = [model_part(u) for u in uploads]
        new = weighted_mean(models, self.client_weights(reports))
        round_idx = int(server_state["feddf.round"])
        if self.opt.distill_steps:
            new = self.distill(new, models, round_idx)
        return new, {"feddf.round": server_state["feddf.round"] + 1}
