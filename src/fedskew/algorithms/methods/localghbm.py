"""localghbm: LocalGHBM (Zaccone et al., TMLR 2025, Sec. 4, the communication-efficient GHBM): GHBM's momentum from
what the client itself saw, so nothing but the model travels. (Family ``drift``; the class's docstring has the
details.)"""

from __future__ import annotations

import torch

from fedskew.algorithms.base import MODEL, Method, Source, as_model_part, builtin, model_part
from fedskew.algorithms.drift import LocalGHBMOptions, _params, _step_scale
from fedskew.algorithms.methods.ghbm import GHBM


@builtin
class LocalGHBM(Method):
    """LocalGHBM (Zaccone et al., TMLR 2025, Sec. 4, the communication-efficient GHBM): GHBM's
    momentum from what the client itself saw, so nothing but the model travels. The client keeps
    the model it received when it last took part (its anchor a_i); this round's momentum is
    m = C (a_i - x_t), C the participation ratio standing for 1 / tau, zero at its first round
    (the official ``LocalGHBMClient._set_momentum``), and every local step adds beta m / (lr K) to
    the gradient, as GHBM (written as the loss CE + beta <m, w> / (lr K)). Afterwards the anchor
    becomes x_t. The server averages as FedAvg."""
    family = "drift"

    name = "localghbm"
    own_optimiser = True
    Options = LocalGHBMOptions
    source = Source(
        authors="Zaccone, Karimireddy, Masone, Ciccone",
        title="Communication-Efficient Heterogeneous Federated Learning with Generalized Heavy-Ball Momentum",
        venue="TMLR",
        year=2025,
        arxiv="2311.18578",
        implements="Sec. 4, LocalGHBM (the client's anchor: the model it last received)",
        code="RickZack/GHBM src/algo/fed_clients/ghbm_client.py (LocalGHBMClient, variant standard), "
        "config/algo/localghbm.yaml",
    )
    per_sample_loss = True  # Method.padding_exact
    run_defaults = GHBM.run_defaults

    def client_init(self, client_id, global_state, info):
        anchor = {k: torch.zeros_like(v) for k, v in _params(info.param_names, global_state, "anchor.").items()}
        return {**anchor, "anchor.seen": torch.zeros((), dtype=next(iter(anchor.values())).dtype)}

    def prepare(self, payload, client_state, data):
        info = self.info
        c = self.opt.participation or info.clients_per_round / info.num_clients
        scale = _step_scale(self.opt.beta * c, data, client_state["anchor.seen"]) * client_state["anchor.seen"]
        return {**client_state, "ghbm.scale": scale}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
        pull = sum(((client_state["anchor." + k] - payload[MODEL + k]) * p).sum() for k, p in params.items())
        return loss + client_state["ghbm.scale"] * pull, aux

    def next_anchor(self, trained, payload):
        """The anchor the client keeps for its next round: the model it received (LocalGHBM)."""
        return model_part(payload)

    def after_training(self, trained, payload, client_state, report):
        new = self.next_anchor(trained, payload)
        state = {**{"anchor." + k: new[k] for k in self.info.param_names},
                 "anchor.seen": torch.ones_like(client_state["anchor.seen"])}
        return as_model_part(trained), state
