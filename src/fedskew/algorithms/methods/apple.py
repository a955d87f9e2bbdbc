"""apple: APPLE (Luo and Wu, IJCAI 2022): each client's model is a learned mixture of every client's core model;
it trains its own core and its mixing weights together. (Family ``sharing``; the class's docstring has the details.)"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from fedskew.algorithms.base import Method, Source, StrictOptions, as_model_part, builtin, model_part, reference_tensor

CORES, P = "apple.cores.", "apple_p"  # every client's core model (server, stacked); the mixing weights' parameter


class APPLEOptions(StrictOptions):
    search = {"mu": [0.01, 0.1, 1.0]}  # the bench's search space (fedskew bench)
    p_lr_ratio: float = Field(0.1, gt=0, description="the mixing weights' learning rate as a share of the local "
                                                     "lr (the official lr_coef 0.001 over lr_net 0.01)")
    mu: float = Field(0.1, ge=0, description="weight of the pull ||p - p0||^2 of the mixing weights towards the "
                                            "clients' data shares, decayed over the first rounds")
    schedule: Literal["exponential", "cosine"] = Field(
        "exponential", description="the pull's decay: mu 0.001^(r / L) (the official default) or mu (cos(pi r / L) "
                                   "+ 1) / 2, and 0 from round L on")
    decay_fraction: float = Field(0.1, gt=0, le=1, description="L as a share of the run's rounds (the official 0.1)")
    cores: Literal["shared", "independent"] = Field(
        "shared", description="the clients' core models all start from the run's initial model (PFLlib's) or from "
                              "independent initialisations (the official code's; their mixture starts near zero)")


def pull_weight(round_idx: int, rounds: int, opt: APPLEOptions) -> float:
    """The official ``get_reg_coef``: 0 from L = int(rounds * decay_fraction) on (and when mu is 0)."""
    last = int(rounds * opt.decay_fraction)
    if opt.mu == 0 or round_idx >= last:
        return 0.0
    if opt.schedule == "cosine":
        return opt.mu * (math.cos(math.pi * round_idx / last) + 1) / 2
    return opt.mu * 0.001 ** (round_idx / last)


def mixture(own: dict, cores: dict, p: torch.Tensor, me: torch.Tensor) -> dict:
    """sum_j p_j w_j with w_j the cores and the client's own core (``me``, one-hot) trained in its place."""
    others = p * (1 - me)
    return {k: torch.tensordot(others, cores[k], dims=1) + (p * me).sum() * v for k, v in own.items()}


@builtin
class APPLE(Method):
    """APPLE (Luo and Wu, IJCAI 2022, "Adapt to Adaptation: Learning Personalization for Cross-Silo
    Federated Learning"), as its official code runs it (ljaiverson/pFL-APPLE, ``train_APPLE.py``,
    ``utils/apple.py``). Every client has a core model (the server keeps them all) and mixing weights p_i
    over all N clients, unconstrained, starting at p0, each client's share of the training samples.
    Its personalised model is sum_j p_ij w_j; it downloads every core and trains its own core and p_i
    together on CE(f(x; sum_j p_ij w_j), y) + lambda(r) ||p_i - p0||^2 (the other cores fixed: its core's
    gradient is p_ii g, p_ij's <g, w_j>), lambda(r) = mu 0.001^(r / L) until L = 0.1 x rounds
    (``pull_weight``), then uploads its core. p_i trains at ``p_lr_ratio`` times the local lr with the
    same momentum (the code's two SGD groups): it is the parameter ``apple_p`` of the architecture,
    scaled by sqrt(ratio) in the mixture. The code trains every client every round (12 silos); here
    the run's clients per round.

    The cores start from the run's initial model (``cores=shared``, as PFLlib's): the official code
    draws each independently (``cores=independent``), and the mixture of 20 independent
    initialisations is near zero, its own core's effective step lr p_ii^2 about lr / 400: on the
    README setting (20 clients, 10 a round) it stayed at 0.30 personalised accuracy after 20 rounds,
    where shared cores reach 0.94.

    PFLlib's APPLE differs (uniform p, its p learning rate and mu 0 by default, so p stays uniform, a
    mean of per-tensor means for p's gradient, the mixture rather than the core carried over): this
    follows the authors' code. No global model: ``personal/*`` scores each client's mixture after
    training. Down: N models; up: one model."""
    family = "sharing"
    fedavg_weighted = False  # each client's core is kept, not averaged (Method.fedavg_weighted)
    sized_by_clients = True

    name = "apple"
    Options = APPLEOptions
    source = Source(
        authors="Luo, Wu",
        title="Adapt to Adaptation: Learning Personalization for Cross-Silo Federated Learning",
        venue="IJCAI",
        year=2022,
        arxiv="2110.08394",
        implements="the directed relationship vectors and the core models (Algorithm 1), the loss scheduler",
        code="ljaiverson/pFL-APPLE (train_APPLE.py, utils/apple.py at 8078196)")
    has_global_model = False
    per_sample_loss = True  # Method.padding_exact

    @classmethod
    def build_model(cls, model, options, rebuild, num_clients=0):
        model.register_parameter(P, nn.Parameter(torch.zeros(max(num_clients, 1))))
        return model

    @property
    def scale(self) -> float:
        return math.sqrt(self.opt.p_lr_ratio)

    def server_init(self, global_state, info):
        cores = [global_state] + [global_state if self.opt.cores == "shared" else info.model_draw(j)
                                  for j in range(1, info.num_clients)]
        state = {CORES + k: torch.stack([c[k] for c in cores]) for k in global_state if k != P}
        state["apple.round"] = torch.zeros((), dtype=torch.long, device=reference_tensor(global_state).device)
        return state

    def client_init(self, client_id, global_state, info):
        ref = reference_tensor(global_state)
        n = info.class_counts.sum(1).to(ref)
        me = torch.zeros_like(n)
        me[client_id] = 1
        mix = {"apple.mix." + k: torch.zeros_like(v) for k, v in global_state.items() if k != P}
        return {"apple.p": n / n.sum(), "apple.me": me, **mix}

    def broadcast(self, global_state, server_state):
        coef = pull_weight(int(server_state["apple.round"]), self.info.rounds, self.opt)
        payload = {k: v for k, v in server_state.items() if k.startswith(CORES)}
        ref = reference_tensor(payload)
        n = self.info.class_counts.sum(1).to(ref)
        coef = torch.tensor(coef, dtype=ref.dtype, device=ref.device)
        return {**payload, "apple.p0": n / n.sum(), "apple.coef": coef}

    def cores(self, payload) -> dict:
        return {k[len(CORES):]: v for k, v in payload.items() if k.startswith(CORES)}

    def local_start(self, payload, client_state):
        me = client_state["apple.me"]
        own = {k: (me.view(-1, *[1] * (v.dim() - 1)) * v).sum(0) for k, v in self.cores(payload).items()}
        return {**own, P: client_state["apple.p"] / self.scale}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        p = params[P] * self.scale
        own = {k: v for k, v in params.items() if k != P}
        _, logits = fwd.call({**mixture(own, self.cores(payload), p, client_state["apple.me"]), P: params[P]}, x)
        pull = (p - payload["apple.p0"]).pow(2).sum()
        return fwd.cross_entropy(logits, y) + payload["apple.coef"] * pull, {"apple/self_weight": (
            p * client_state["apple.me"]).sum().detach()}

    def after_training(self, trained, payload, client_state, report):
        p = trained[P] * self.scale
        own = {k: v for k, v in trained.items() if k != P}
        mixed = mixture(own, self.cores(payload), p, client_state["apple.me"])
        state = {**client_state, "apple.p": p, **{"apple.mix." + k: v for k, v in mixed.items()}}
        return as_model_part(own), state

    def personal_state(self, trained, client_state):
        mixed = {k[len("apple.mix."):]: v for k, v in client_state.items() if k.startswith("apple.mix.")}
        return {**trained, **mixed}

    def aggregate(self, server_state, global_state, uploads, reports):
        new = dict(server_state)
        for u, r in zip(uploads, reports):
            for k, v in model_part(u).items():
                new[CORES + k] = new[CORES + k].index_copy(0, torch.tensor([r.client_id], device=v.device), v[None])
        new["apple.round"] = server_state["apple.round"] + 1
        return global_state, new
