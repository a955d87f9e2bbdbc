"""Client-drift baselines: FedProx, SCAFFOLD, FedCM, GHBM (with LocalGHBM and FedHBM), FedDyn, FedNova;
and sharpness-aware local steps, FedSAM and FedASAM (FedAvg + the ``sam`` component; the two passes
live in the executors' step).

Each is FedAvg with the pieces its paper changes. SCAFFOLD's and FedDC's control correction is a
step correction applied after each optimizer step, outside momentum (``Method.step_correction``);
the loss-term form (gradient of <c - c_i, theta>) stays as ``correction=loss``. Controls and dual variables cover the
trainable parameters (``info.param_names``); BatchNorm statistics are averaged as in FedAvg.

Each method of the family is a module of its own in :mod:`fedskew.algorithms.methods` (its class names the
family); this module holds the pieces several of them share.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions
from fedskew.algorithms.components import SAMOptions


def _params(names, state, prefix=""):
    return {prefix + k: state[k] for k in names}


def _step_scale(weight: float, data, like: torch.Tensor) -> torch.Tensor:
    """weight / (lr K), K the client's local steps this round: the factor by which FedCM's and the GHBM
    family's official clients divide a round-level displacement added to every step's gradient
    (``_before_opt_step``); 0 at lr 0."""
    return torch.tensor(weight / (data.lr * max(data.steps, 1)) if data.lr > 0 else 0.0, dtype=like.dtype)


def effective_steps(tau: int, rho: float) -> float:
    """FedNova's a_i: how many plain-SGD steps tau steps with momentum rho amount to,
    [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho) (= tau when rho = 0)."""
    if rho == 0:
        return float(tau)
    return (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho)


def control_scale(report, mode: str) -> float:
    """1 / (steps * eta) in option II's control update c_i+ = c_i - c + (x - y) * scale. ``steps``
    (paper): tau local steps; ``momentum``: FedNova's effective steps a_i(tau, rho), so that with
    local momentum the control estimates the mean gradient instead of about 1/(1 - rho) times it."""
    steps = report.num_steps if mode == "steps" else effective_steps(report.num_steps, report.momentum)
    return 1.0 / (steps * report.lr)


Correction = Literal["after_step", "loss"]


CORRECTION_DOC = ("after_step: p -= lr (c - c_i) after each optimizer step, outside momentum and weight decay "
                  "(NIID-Bench; default); loss: the term <c - c_i, theta>, which passes through momentum")


class LocalGHBMOptions(FedAvgOptions):
    search = {"beta": [0.5, 0.9, 0.99]}  # the bench's search space (fedskew bench)
    beta: float = Field(0.9, ge=0, description="momentum weight: each step adds beta m / (lr K)")
    participation: float | None = Field(
        None, gt=0, le=1, description="C, the factor of the client's displacement (default: clients_per_round / "
                                      "num_clients, the official configs' participation ratio)")


class FedSAMOptions(SAMOptions, FedAvgOptions):
    pass
