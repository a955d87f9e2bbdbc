"""ghbm: GHBM (Zaccone, Karimireddy, Masone, Ciccone, TMLR 2025, Algorithm 1, non-Nesterov form): generalized
heavy-ball momentum. (Family ``drift``; the class's docstring has the details.)"""

from __future__ import annotations

import torch
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, as_model_part, builtin, model_part, weighted_mean
from fedskew.algorithms.drift import _params, _step_scale


class GHBMOptions(FedAvgOptions):
    search = {"beta": [0.5, 0.9, 0.99]}  # the bench's search space (fedskew bench)
    beta: float = Field(0.9, ge=0, lt=1, description="momentum weight: each step adds beta m / (lr K)")
    tau: int | None = Field(None, ge=1, description="rounds the momentum spans (default: the inverse participation, "
                                                    "round(num_clients / clients_per_round), the paper's choice)")


@builtin
class GHBM(Method):
    """GHBM (Zaccone, Karimireddy, Masone, Ciccone, TMLR 2025, Algorithm 1, non-Nesterov form):
    generalized heavy-ball momentum. The server keeps its last tau models and broadcasts
    m = (x_{t+1-tau} - x_{t+1}) / tau, the mean displacement over tau rounds (none before tau
    rounds; tau = 1 is classical server momentum); every local step adds beta m / (lr K) to the
    gradient, K the client's local steps (the authors' ``_before_opt_step``), written as the loss
    CE + beta <m, w> / (lr K). The server averages as FedAvg (server lr 1). tau defaults to the
    inverse participation ratio, with which the paper's analysis removes the effect of client
    heterogeneity under partial participation."""
    family = "drift"

    name = "ghbm"
    own_optimiser = True
    Options = GHBMOptions
    source = Source(
        authors="Zaccone, Karimireddy, Masone, Ciccone",
        title="Communication-Efficient Heterogeneous Federated Learning with Generalized Heavy-Ball Momentum",
        venue="TMLR",
        year=2025,
        arxiv="2311.18578",
        implements="Algorithm 1 (GHBM, non-Nesterov)",
        code="RickZack/GHBM src/algo/fed_clients/ghbm_client.py, center_server/ghbm_center_server.py, "
        "config/algo/ghbm.yaml",
    )
    per_sample_loss = True  # Method.padding_exact
    # the official client (config/algo/optim/sgd.yaml): SGD lr 0.1, no momentum, weight decay 1e-4
    run_defaults = {"lr": 0.1, "momentum": 0.0, "weight_decay": 1e-4}

    @property
    def tau(self) -> int:
        info = self.info
        return self.opt.tau or max(1, round(info.num_clients / max(info.clients_per_round, 1)))

    @classmethod
    def inert(cls, options, rounds, num_clients, clients_per_round):
        tau = options.tau or max(1, round(num_clients / max(clients_per_round, 1)))
        if tau >= rounds:
            return (f"tau = {tau} is not below rounds = {rounds}: the momentum needs tau rounds of models, so none "
                    f"exists in this run and it is FedAvg")

    def server_init(self, global_state, info):
        return {**{k: torch.zeros_like(v) for k, v in _params(info.param_names, global_state, "m.").items()},
                "past": torch.zeros((), dtype=torch.long)}

    def broadcast(self, global_state, server_state):
        return {**as_model_part(global_state), **{k: v for k, v in server_state.items() if k.startswith("m.")}}

    def prepare(self, payload, client_state, data):
        return {**client_state, "ghbm.scale": _step_scale(self.opt.beta, data,
                                                          payload["model." + self.info.param_names[0]])}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
        pull = sum((payload["m." + k] * p).sum() for k, p in params.items())
        return loss + client_state["ghbm.scale"] * pull, aux

    def after_training(self, trained, payload, client_state, report):
        return as_model_part(trained), {k: v for k, v in client_state.items() if k != "ghbm.scale"}

    def aggregate(self, server_state, global_state, uploads, reports):
        names, tau = self.info.param_names, self.tau
        mean = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        # the queue of the last tau models before aggregation (oldest first): x_{t+1-tau} .. x_t
        queue = [{k: server_state[f"past{i}.{k}"] for k in names} for i in range(int(server_state["past"]))]
        queue = (queue + [{k: global_state[k] for k in names}])[-tau:]
        state = {f"past{i}.{k}": q[k] for i, q in enumerate(queue) for k in names}
        state["past"] = torch.tensor(len(queue))
        full = len(queue) >= tau
        state.update({"m." + k: (queue[0][k] - mean[k]) / tau if full else torch.zeros_like(mean[k]) for k in names})
        return mean, state
