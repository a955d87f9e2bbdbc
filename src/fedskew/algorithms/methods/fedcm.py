"""fedcm: FedCM (Xu et al., 2021, Algorithm 1): client-level momentum. (Family ``drift``; the class's docstring has
the details.)"""

from __future__ import annotations

import torch
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, as_model_part, builtin, model_part, weighted_mean
from fedskew.algorithms.drift import _params, _step_scale


class FedCMOptions(FedAvgOptions):
    search = {"alpha": [0.05, 0.1, 0.3]}  # the bench's search space (fedskew bench)
    alpha: float = Field(0.1, gt=0, lt=1, description="weight of the local gradient: each step follows alpha g + "
                                                      "(1 - alpha) Delta / (lr K)")


@builtin
class FedCM(Method):
    """FedCM (Xu et al., 2021, Algorithm 1): client-level momentum. Every local step follows
    alpha g + (1 - alpha) Delta / (lr K), with Delta the last round's global pseudo-gradient
    x_{t-1} - x_t (zero in round 1) and K the client's local steps this round (the official
    implementation's ``_before_opt_step``, which divides on the client by its own lr and step count;
    Algorithm 1 divides on the server by a common lr K). Written as the loss alpha CE + (1 - alpha)
    <Delta, w> / (lr K), whose gradient is that direction before weight decay and clipping, as the
    official client modifies the gradient before its optimizer step and its clipping. The server
    averages as FedAvg (server lr 1) and keeps Delta = x - sum_k p_k theta_k over the trainable
    parameters."""
    family = "drift"

    @classmethod
    def inert(cls, options, rounds, num_clients, clients_per_round):
        if options.alpha < 1e-6:
            return (f"alpha = {options.alpha:g} weighs the local gradient by under 1e-6: round 1's steps are alpha "
                    f"times FedAvg's and the momentum is what they moved, so nothing trains")

    name = "fedcm"
    own_optimiser = True  # (Method.own_optimiser)
    Options = FedCMOptions
    source = Source(authors="Xu, Wang, Wang, Yao", title="FedCM: Federated Learning with Client-level Momentum",
                    venue="arXiv preprint", year=2021, arxiv="2106.10874",
                    implements="Algorithm 1 (client-level momentum)",
                    code="RickZack/GHBM src/algo/fed_clients/fedcm_client.py, center_server/fedcm_center_server.py "
                         "(the GHBM authors' FedCM, a Flower-baselines reference)")
    per_sample_loss = True  # Method.padding_exact
    # the official client (GHBM config/algo/optim/sgd.yaml): SGD lr 0.1, no momentum (FedCM's is its
    # own), weight decay 1e-4; at fedskew's lr 0.01 without momentum it trains ten times slower
    run_defaults = {"lr": 0.1, "momentum": 0.0, "weight_decay": 1e-4}

    def server_init(self, global_state, info):
        return {k: torch.zeros_like(v) for k, v in _params(info.param_names, global_state, "delta.").items()}

    def broadcast(self, global_state, server_state):
        return {**as_model_part(global_state), **server_state}

    def prepare(self, payload, client_state, data):
        return {**client_state, "fedcm.scale": _step_scale(1 - self.opt.alpha, data,
                                                           payload["delta." + self.info.param_names[0]])}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
        pull = sum((payload["delta." + k] * p).sum() for k, p in params.items())
        return self.opt.alpha * loss + client_state["fedcm.scale"] * pull, aux

    def after_training(self, trained, payload, client_state, report):
        return as_model_part(trained), {k: v for k, v in client_state.items() if k != "fedcm.scale"}

    def aggregate(self, server_state, global_state, uploads, reports):
        mean = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        return mean, {"delta." + k: global_state[k] - mean[k] for k in self.info.param_names}
