"""fedexp: FedExP (Jhunjhunwala, Wang, Joshi, ICLR 2023, Algorithm 1): FedAvg's pseudo-gradient taken with an
adaptive server step, x <- x + eta_g Delta, Delta = sum_k p_k Delta_k, Delta_k = theta_k - x, eta_g = max(1,
sum_k p_k ||Delta_k||^2 / (2 (||Delta||^2 + |S| eps))) (the official code's ``eta_g``; the paper's text writes +
eps), over the trainable parameters (BatchNorm statistics take the weighted mean). (Family ``server_opt``; the
class's docstring has the details.)"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin, model_part, weighted_mean


class FedExPOptions(FedAvgOptions):
    """FedExP's step size reads epsilon; the official code scales it by the clients of the round."""
    search = {"epsilon": [1e-3, 1e-2, 1e-1]}  # the bench's search space (fedskew bench)
    epsilon: float = Field(
        1e-3,
        gt=0,
        allow_inf_nan=False,
        description="eps of eta_g's denominator (official code: CIFAR-10/100 and CINIC-10 0.001, EMNIST 0.1)",
    )
    epsilon_scale: Literal["clients", "paper"] = Field(
        "clients", description="clients: the official code's ||Delta||^2 + |S| eps; paper: + eps")
    eval_average: bool = Field(True, description="score the mean of the last two global models (the official "
                                                 "code's net_eval; training goes on from the last)")
    schedule: Literal["official", "constant"] = Field(
        "official", description="official: in round t (from 0) the local lr is lr 0.998^(t+1) and epsilon is "
                                "epsilon 0.998^(2(t+1)) (the official main.py decays both at the top of every round); "
                                "constant: both as given")
    local_steps: int = Field(0, ge=0, le=10 ** 6, description="local steps per round, whatever the client's size "
                                                              "(the official code's cp: 20); 0: the run's E epochs")


@builtin
class FedExP(Method):
    """FedExP (Jhunjhunwala, Wang, Joshi, ICLR 2023, Algorithm 1): FedAvg's pseudo-gradient taken with
    an adaptive server step, x <- x + eta_g Delta, Delta = sum_k p_k Delta_k, Delta_k = theta_k - x,
    eta_g = max(1, sum_k p_k ||Delta_k||^2 / (2 (||Delta||^2 + |S| eps))) (the official code's
    ``eta_g``; the paper's text writes + eps), over the trainable parameters (BatchNorm statistics
    take the weighted mean). The metrics score the mean of the last two global models
    (``eval_average``, the official code's ``w_vec_avg``), from the second round on. The official
    schedule (``schedule=official``, main.py's ``decay``): round t's local lr is lr 0.998^(t+1) and
    its epsilon epsilon 0.998^(2(t+1)); ``local_steps`` fixes the steps per round (its cp)."""
    family = "server_opt"

    DECAY = 0.998  # main.py's decay
    source = Source(authors="Jhunjhunwala, Wang, Joshi",
                    title="FedExP: Speeding Up Federated Averaging via Extrapolation", venue="ICLR", year=2023,
                    arxiv="2301.09604", implements="Algorithm 1 (the server step size eta_g), the last-two average",
                    code="Divyansh03/FedExP main.py (eta_g, w_vec_avg), util_general.py (LocalUpdate)")
    name, Options = "fedexp", FedExPOptions
    # the official client: plain SGD (momentum 0), weight decay 1e-4, gradient norm clipped at 10
    run_defaults = {"momentum": 0.0, "weight_decay": 1e-4, "grad_clip": 10.0}
    INERT_EPSILON = 1e3  # 10^4 times the official code's largest (EMNIST's 0.1)

    @classmethod
    def inert(cls, options, rounds, num_clients, clients_per_round):
        if options.epsilon > cls.INERT_EPSILON:
            scale = clients_per_round if options.epsilon_scale == "clients" else 1
            return (f"epsilon = {options.epsilon:g}: eta_g = max(1, spread / 2(||Delta||^2 + eps)) exceeds 1 only when "
                    f"the clients' mean squared update norm is over 2 x {options.epsilon:g} x {scale}, so the "
                    f"extrapolation stays off and this run is FedAvg in practice (the official code's epsilon is "
                    f"1e-3 to 0.1)")

    def server_init(self, global_state, info):
        return {"eta_g": torch.ones((), dtype=torch.float64), "rounds": torch.zeros((), dtype=torch.long)}

    def aggregate(self, server_state, global_state, uploads, reports):
        o, names = self.opt, self.info.param_names
        w, models = self.client_weights(reports), [model_part(u) for u in uploads]
        mean = weighted_mean(models, w)
        spread = sum(float(p) * sum(float((m[k] - global_state[k]).double().pow(2).sum()) for k in names)
                     for p, m in zip(w, models))
        delta = {k: mean[k] - global_state[k] for k in names}
        norm = sum(float(d.double().pow(2).sum()) for d in delta.values())
        t = int(server_state["rounds"])
        eps = o.epsilon * (len(uploads) if o.epsilon_scale == "clients" else 1) * self._decay(t) ** 2
        eta = max(1.0, 0.5 * spread / (norm + eps))
        new = {**mean, **{k: global_state[k] + eta * d for k, d in delta.items()}}
        state = {"eta_g": torch.tensor(eta, dtype=torch.float64), "rounds": server_state["rounds"] + 1}
        if o.eval_average:
            state.update({"prev." + k: global_state[k] for k in names})
        return new, state

    def _decay(self, round_idx: int) -> float:
        return self.DECAY ** (round_idx + 1) if self.opt.schedule == "official" else 1.0

    def lr_scale(self, round_idx):
        return self._decay(round_idx)

    def local_steps(self, round_idx, total_steps, steps_per_epoch):
        return self.opt.local_steps or total_steps

    def evaluation_state(self, global_state, server_state):
        if not self.opt.eval_average or int(server_state.get("rounds", 0)) < 2:
            return global_state
        return {**global_state, **{k: (global_state[k] + server_state["prev." + k]) / 2 for k in self.info.param_names}}
