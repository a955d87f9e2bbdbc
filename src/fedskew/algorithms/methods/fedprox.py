"""fedprox: FedProx (Li et al., 2020, Eq. 2): CE + (mu/2) ||w - w^t||^2 over the trainable parameters, every batch.
(Family ``drift``; the class's docstring has the details.)"""

from __future__ import annotations

from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin


class FedProxOptions(FedAvgOptions):
    search = {'mu': [0.001, 0.01, 0.1]}  # the bench's search space (fedskew bench)
    mu: float = Field(0.01, ge=0, description="proximal weight")


@builtin
class FedProx(Method):
    """FedProx (Li et al., 2020, Eq. 2): CE + (mu/2) ||w - w^t||^2 over the trainable parameters,
    every batch. Sends and keeps what FedAvg does."""
    family = "drift"

    name = "fedprox"
    Options = FedProxOptions
    source = Source(
        authors="Li et al.",
        title="Federated Optimization in Heterogeneous Networks",
        venue="MLSys",
        year=2020,
        arxiv="1812.06127",
        implements="Eq. 2 (the proximal local objective)",
        code="litian96/FedProx")
    per_sample_loss = True  # Method.padding_exact

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
        prox = sum((p - payload["model." + k]).pow(2).sum() for k, p in params.items())
        return loss + 0.5 * self.opt.mu * prox, {**aux, "fedprox/prox": prox.detach()}
