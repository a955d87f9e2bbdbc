"""fedacg: FedACG (Kim, Kim and Han, CVPR 2024): the server sends the lookahead w + lambda m, clients train with a
proximal term to it, m <- lambda m + Delta. (Family ``server_opt``; the class's docstring has the details.)"""

from __future__ import annotations

import torch
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, as_model_part, builtin, model_part, weighted_mean


class FedACGOptions(FedAvgOptions):
    search = {"beta": [0.001, 0.01]}  # the bench's search space (fedskew bench)
    lam: float = Field(0.85, ge=0, lt=1, description="lambda: the global momentum's decay and the lookahead "
                                                     "w + lambda m the server sends")
    beta: float = Field(0.001, ge=0, description="weight of the client's proximal term beta ||w - (w^t + lambda "
                                                 "m^t)||^2 (the official code's, without a 1/2)")


def lookahead(global_state: dict, momentum: dict, lam: float) -> dict:
    """The accelerated model the clients start from: w^t + lambda m^t for every trainable tensor
    (the other tensors, BatchNorm statistics, as they are)."""
    return {k: v + lam * momentum[k] if k in momentum else v for k, v in global_state.items()}


def server_step(global_state: dict, momentum: dict, mean: dict, lam: float) -> tuple[dict, dict]:
    """(w^{t+1}, m^{t+1}): the mean of the clients' models, and m^{t+1} = lambda m^t + (mean - (w^t
    + lambda m^t)), the mean update taken from the lookahead; so w^{t+1} = w^t + m^{t+1}."""
    ahead = lookahead(global_state, momentum, lam)
    return dict(mean), {k: lam * m + (mean[k] - ahead[k]) for k, m in momentum.items()}


@builtin
class FedACG(Method):
    """FedACG (Kim, Kim and Han, CVPR 2024, "Communication-Efficient Federated Learning with
    Accelerated Client Gradient"). The server keeps a global momentum m (m^0 = 0) and sends the
    lookahead w^t + lambda m^t instead of w^t; each client trains from it on CE + beta ||w - (w^t +
    lambda m^t)||^2 over the trainable parameters (the official code's term, no 1/2, beta 1e-3,
    lambda 0.85). The server's new model is the mean of the clients' models, and m^{t+1} = lambda
    m^t + Delta^t with Delta^t the mean update from the lookahead, so w^{t+1} = w^t + m^{t+1}: FedAvgM's
    recursion with the momentum step taken before local training. The round's metrics score
    w^{t+1}, not the lookahead. The official code averages uniformly over the clients of its
    equal-sized splits; here the run's FedAvg weights (by samples unless ``weighting`` says
    otherwise). BatchNorm statistics take the mean and no momentum. Communication as FedAvg; the
    server keeps m."""
    family = "server_opt"

    name = "fedacg"
    Options = FedACGOptions
    source = Source(
        authors="Kim, Kim, Han",
        title="Communication-Efficient Federated Learning with Accelerated Client Gradient",
        venue="CVPR",
        year=2024,
        arxiv="2201.03172",
        implements="Algorithm 1 (the lookahead broadcast, the proximal local objective, the momentum update)",
        code="geehokim/FedACG (servers/base.py ServerM, clients/base_client.py, configs/server/FedACG.yaml, "
             "configs/client/ACG.yaml at 62b6e95)")
    per_sample_loss = True  # Method.padding_exact

    def server_init(self, global_state, info):
        return {"acg.m." + k: torch.zeros_like(global_state[k]) for k in info.param_names}

    def momentum(self, server_state: dict) -> dict:
        return {k[len("acg.m."):]: v for k, v in server_state.items() if k.startswith("acg.m.")}

    def broadcast(self, global_state, server_state):
        return as_model_part(lookahead(global_state, self.momentum(server_state), self.opt.lam))

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
        prox = sum((p - payload["model." + k]).pow(2).sum() for k, p in params.items())
        return loss + self.opt.beta * prox, {**aux, "fedacg/prox": prox.detach()}

    def aggregate(self, server_state, global_state, uploads, reports):
        mean = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        new, m = server_step(global_state, self.momentum(server_state), mean, self.opt.lam)
        return new, {"acg.m." + k: v for k, v in m.items()}
