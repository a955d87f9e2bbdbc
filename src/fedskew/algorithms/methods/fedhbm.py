"""fedhbm: FedHBM (Zaccone et al., TMLR 2025, Sec. 4): LocalGHBM whose anchor is the model the client itself
trained when it last took part, and whose momentum follows the model being trained: step s adds beta C (a_i -
w_s) / (lr K) to the gradient (the official ``FedHBMClient`` recomputes the momentum before every step), the
gradient of the loss term -beta C ||a_i - w||^2 / (2 lr K); zero at the client's first round. (Family ``drift``;
the class's docstring has the details.)"""

from __future__ import annotations

from pydantic import Field

from fedskew.algorithms.base import Method, Source, builtin
from fedskew.algorithms.drift import LocalGHBMOptions
from fedskew.algorithms.methods.localghbm import LocalGHBM


class FedHBMOptions(LocalGHBMOptions):
    search = {"beta": [0.5, 0.9, 1.0]}  # the bench's search space (fedskew bench)
    beta: float = Field(1.0, ge=0, description="momentum weight: each step adds beta m / (lr K) (the official "
                                               "config's 1)")


@builtin
class FedHBM(LocalGHBM):
    """FedHBM (Zaccone et al., TMLR 2025, Sec. 4): LocalGHBM whose anchor is the model the client
    itself trained when it last took part, and whose momentum follows the model being trained:
    step s adds beta C (a_i - w_s) / (lr K) to the gradient (the official ``FedHBMClient`` recomputes
    the momentum before every step), the gradient of the loss term -beta C ||a_i - w||^2 / (2 lr K);
    zero at the client's first round. beta is 1 in the official config."""
    family = "drift"

    name = "fedhbm"
    Options = FedHBMOptions
    source = Source(
        authors="Zaccone, Karimireddy, Masone, Ciccone",
        title="Communication-Efficient Heterogeneous Federated Learning with Generalized Heavy-Ball Momentum",
        venue="TMLR",
        year=2025,
        arxiv="2311.18578",
        implements="Sec. 4, FedHBM (the client's anchor: the model it last trained)",
        code="RickZack/GHBM src/algo/fed_clients/ghbm_client.py (FedHBMClient, variant standard), "
        "config/algo/fedhbm.yaml",
    )
    per_sample_loss = True  # Method.padding_exact

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = Method.local_loss(self, fwd, params, x, y, payload, client_state)
        spread = sum(((client_state["anchor." + k] - p) ** 2).sum() for k, p in params.items())
        return loss - client_state["ghbm.scale"] / 2 * spread, aux

    def next_anchor(self, trained, payload):
        """The model the client trained this round (FedHBM)."""
        return trained
