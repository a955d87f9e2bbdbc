"""Partial model sharing and model mixing: FedBN, FedPer, LG-FedAvg, APFL, FedALA, FedFOMO, FedAMP,
FLDA, FedDBE, FedAS, FedCAC and FedAH.

Methods of this family differ from FedAvg in *which* tensors of the model a client shares and how
it combines what it receives with what it keeps:

=========  =====================================  =====================================  ==============
method     kept on the client                     sent up and averaged                   global model
=========  =====================================  =====================================  ==============
fedbn      normalisation layers (BN params+stats)  every other tensor                     FedAvg's if the
                                                                                         model has no BN
fedper     the head (``classifier.*``)            the body                               none
lgfedavg   the body (all but the last layers)     the last ``global_layers`` layers      none
apfl       a personal model v and the mixture     the global model w (FedAvg's)          FedAvg's
fedala     the local model                        the locally trained model (FedAvg's)   FedAvg's
fedfomo    its own model                          its model + weights (server keeps all) none
fedamp     its own model                          its model (server keeps all, mixes)    none
flda       a private model and the gate           the model (FedAvg's)                   FedAvg's
feddbe     its representation bias mu_k (d)       the model without mu_k (FedAvg's)      FedAvg's
fedas      its head (the body: the aligned global) the model + its Fisher trace            Fisher-weighted
fedcac     its critical-parameter mask            the model + the mask (server keeps a   FedAvg's
                                                  customised model per client)
fedah      its head and the head's mixing weights  the model                              FedAvg's
=========  =====================================  =====================================  ==============

A method without a global model reports ``global/*`` as none (``has_global_model``); FedBN has one
only when the model has no normalisation layer (its BN layers never leave the clients).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from fedskew.algorithms.base import (
    HEAD,
    ClientData,
    FedAvgOptions,
    Method,
    Source,
    State,
    add_prefix,
    as_model_part,
    body_names,
    builtin,
    copies,
    head_names,
    model_part,
    reference_tensor,
    strip_prefix,
    weighted_mean,
)
from fedskew.algorithms.compose import PartialSharing
from fedskew.algorithms.tensors import class_feature_means
from fedskew.models.nets import PrivateExpertNet
from fedskew.streams import numpy_rng


@builtin
class FedBN(PartialSharing):
    """FedBN (Li et al., ICLR 2021, Algorithm 1): FedAvg in which every client keeps its own
    normalisation layers (BatchNorm weight, bias and running statistics; also GroupNorm and
    LayerNorm, ``FederationInfo.norm_names``); they are neither sent up nor overwritten by the
    received model. The paper evaluates each client with its own BN layers: the personalised
    model. The server never sees BN statistics, so a model with normalisation layers has no
    global model to score (``global/*`` none); without any (the MLP) FedBN is exactly FedAvg.

    Down and up: the model without its normalisation tensors. Keeps those per client."""

    name = "fedbn"
    source = Source(
        authors="Li et al.",
        title="FedBN: Federated Learning on Non-IID Features via Local Batch Normalization",
        venue="ICLR",
        year=2021,
        arxiv="2102.07623",
        implements="Algorithm 1",
        code="med-air/FedBN")
    keep = "bn."

    def __init__(self, options=None, info=None):
        super().__init__(options, info)
        self.has_global_model = not (info is not None and info.norm_names)

    def shared(self, key):
        return key not in self.info.norm_names


@builtin
class FedPer(PartialSharing):  # FedRep (personalized.py) is the same sharing with alternating stages
    """FedPer (Arivazhagan et al., 2019): base layers shared, personalisation layers kept. Each
    round the client trains body and its own head together (E epochs, one stage; unlike FedRep's
    alternating head-then-body epochs); only the body is averaged. Personalised model: the new
    body with the client's head. The server has no head: ``global/*`` is none.

    Down and up: the body (BatchNorm statistics included). Keeps the head per client."""

    name = "fedper"
    source = Source(
        authors="Arivazhagan et al.",
        title="Federated Learning with Personalization Layers",
        venue="arXiv preprint",
        year=2019,
        arxiv="1912.00818",
        implements="Algorithm 1 (base layers shared, personalisation layers kept)",
        code="no official code; the paper's Algorithm 1")
    keep = "per."
    requires_classifier = "linear"
    has_global_model = False

    def shared(self, key):
        return not key.startswith(HEAD)


@builtin
class Local(PartialSharing):
    """Local training only: each client trains its own model (initialised from the first global
    model) on its own data, E epochs in each round it is selected; nothing is sent or averaged.
    The lower bound a personalised method must beat (PFLlib's "Local"). Personalised model: the
    client's own model. No global model: ``global/*`` is none.

    Down and up: nothing. Keeps a whole model per client."""

    fedavg_weighted = False  # nothing aggregated (Method.fedavg_weighted)

    name = "local"
    source = Source(
        authors="(none)",
        title="local training only: each client's own model, nothing shared; the lower bound of personalised tables "
              "(MAP Table II's 'Local')",
        venue="no paper",
        year=None,
        implements="local SGD on the client's data",
        code="no reference code: plain local SGD")
    keep = "own."
    has_global_model = False

    def shared(self, key):
        return False


def layer_names(info) -> list[str]:
    """The model's parameterised layers (module paths), input to output, in parameter order."""
    layers: list[str] = []
    for name in info.param_names:
        layer = name.rsplit(".", 1)[0]
        if not layers or layers[-1] != layer:
            layers.append(layer)
    return layers


class LGFedAvgOptions(FedAvgOptions):
    search = {'global_layers': [1, 2]}  # the bench's search space (fedskew bench)
    global_layers: int = Field(1, ge=1, description="number of last parameterised layers shared and averaged "
                                                    "(official code's num_layers_keep; 1: the classifier)")


@builtin
class LGFedAvg(PartialSharing):
    """LG-FedAvg (Liang et al., 2020, Algorithm 1): local representations, global head. Each
    client keeps its own lower layers (the representation) and shares the last ``global_layers``
    parameterised layers, which the server averages. Every round the client trains its whole model
    from its own body and the received top layers. Personalised model: the client's body with the
    new top layers. The paper initialises from a FedAvg-trained model; here every client starts
    from the common initial model (documented difference). No global model (``global/*`` none):
    the server holds no body.

    Down and up: the top layers. Keeps the body per client."""

    name = "lgfedavg"
    Options = LGFedAvgOptions
    source = Source(
        authors="Liang et al.",
        title="Think Locally, Act Globally: Federated Learning with Local and Global Representations",
        venue="arXiv preprint",
        year=2020,
        arxiv="2001.01523",
        implements="Algorithm 1",
        code="pliang279/LG-FedAvg")
    keep = "lg."
    has_global_model = False

    def __init__(self, options=None, info=None):
        super().__init__(options, info)
        layers = layer_names(info) if info is not None else []
        if info is not None and self.opt.global_layers >= len(layers):
            raise ValueError(f"method.global_layers = {self.opt.global_layers} is not allowed: the model has "
                             f"{len(layers)} parameterised layers and at least one must stay local")
        self._top = tuple(layers[-self.opt.global_layers:])

    def shared(self, key):
        return key.rsplit(".", 1)[0] in self._top


# ---------------------------------------------------------------------------------------------
# APFL


class APFLOptions(FedAvgOptions):
    search = {'alpha': [0.25, 0.5, 0.75]}  # the bench's search space (fedskew bench)
    alpha: float = Field(0.5, ge=0, le=1, description="mixing weight of the personal model: v_bar = alpha v + "
                                                      "(1 - alpha) w (FL-bench's initial value); with "
                                                      "alpha_mode=adaptive, every client's starting value")
    alpha_mode: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed: alpha never changes (default); adaptive: the paper's update alpha <- alpha - "
                             "alpha_lr <v - w, grad f(v_bar)>, once per visit, clipped to [0, 1]")
    alpha_lr: float = Field(0.01, gt=0, description="adaptive: the learning rate of alpha")

    @model_validator(mode="after")
    def _positive_fixed_alpha(self):
        if self.alpha_mode == "fixed" and self.alpha == 0:
            raise ValueError("alpha = 0 with alpha_mode=fixed never trains the personal model; use alpha > 0")
        return self


def apfl_alpha_step(alpha: torch.Tensor, v: State, w: State, grad: State, lr: float) -> torch.Tensor:
    """APFL's alpha update (Deng et al., 2020, Algorithm 1, line 8): grad_alpha f(v_bar) =
    <v - w, grad f(v_bar)> over the trainable tensors, alpha <- clip(alpha - lr grad_alpha, 0, 1)."""
    g = sum((v[k] - w[k]).flatten() @ grad[k].flatten() for k in grad)
    return torch.clamp(alpha - lr * g, 0.0, 1.0)


@builtin
class APFL(Method):
    """APFL (Deng et al., 2020, Algorithm 1). Each client keeps a personal model v; its
    personalised model is the mixture v_bar = alpha v + (1 - alpha) w of v and the local version
    w of the global model. The global model trains as in FedAvg (uploaded, averaged); v trains on
    the loss of the mixture, grad_v f(v_bar) = alpha grad f(v_bar), for as many steps as the
    global update, after it, with w the round's locally trained global model (Algorithm 1
    interleaves the two updates step by step).

    ``alpha_mode=fixed`` (default): SGD on v (learning rate eta) runs as SGD on v_bar itself with w
    held fixed and learning rate eta alpha^2 (v_bar <- v_bar - eta alpha^2 grad f(v_bar) is exactly
    v <- v - eta alpha grad f(v_bar); with momentum too; weight decay, if set, applies to v_bar).
    ``alpha_mode=adaptive``: alpha is each client's own (kept in its state) and the stage trains v
    itself on f(alpha v + (1 - alpha) w); at the start of each visit after the first, alpha takes
    one step of Algorithm 1's update on the full local gradient at the last visit's v_bar
    (:func:`apfl_alpha_step`; Algorithm 1 takes one per local step).

    Down and up: what FedAvg sends. Keeps v and the round's local w per client (2 models; +1
    float, alpha, when adaptive)."""

    name = "apfl"
    Options = APFLOptions
    source = Source(
        authors="Deng, Kamani, Mahdavi",
        title="Adaptive Personalized Federated Learning",
        venue="arXiv preprint",
        year=2020,
        arxiv="2003.13461",
        implements="Algorithm 1 (the mixture of personal and global models with adaptive alpha)",
        code="MLOPTPSU/FedTorch")
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss in both stages)

    def client_init(self, client_id, global_state, info):
        state = {**add_prefix({k: v.clone() for k, v in global_state.items()}, "apfl.v."),
                 **add_prefix({k: v.clone() for k, v in global_state.items()}, "apfl.w.")}
        if self.opt.alpha_mode == "adaptive":
            state["apfl.alpha"] = torch.tensor(self.opt.alpha, dtype=reference_tensor(global_state).dtype,
                                               device=reference_tensor(global_state).device)
        return state

    def prepare(self, payload, client_state, data: ClientData):
        if self.opt.alpha_mode != "adaptive":
            return client_state
        v, w = strip_prefix(client_state, "apfl.v."), strip_prefix(client_state, "apfl.w.")
        mixed = self._mix(v, w, client_state)
        params = {k: mixed[k].detach().requires_grad_(True) for k in self.info.param_names}
        _, logits = self.info.model_call({**mixed, **params}, data.x)
        grad = dict(zip(params, torch.autograd.grad(F.cross_entropy(logits, data.y), list(params.values()))))
        return {**client_state, "apfl.alpha": apfl_alpha_step(client_state["apfl.alpha"], v, w, grad,
                                                             self.opt.alpha_lr).detach()}

    def after_training(self, trained, payload, client_state, report):
        return as_model_part(trained), {**client_state, **add_prefix(trained, "apfl.w.")}

    def split_steps(self, total_steps, lr):
        return total_steps, total_steps, lr * self.opt.alpha ** 2 if self.opt.alpha_mode == "fixed" else lr

    def _alpha(self, client_state):
        return client_state["apfl.alpha"] if self.opt.alpha_mode == "adaptive" else self.opt.alpha

    def _mix(self, v, w, client_state):
        a = self._alpha(client_state)
        return {k: a * v[k] + (1 - a) * w[k] if v[k].is_floating_point() else w[k] for k in w}

    def personal_start(self, trained, payload, client_state):
        v = strip_prefix(client_state, "apfl.v.")
        return v if self.opt.alpha_mode == "adaptive" else self._mix(v, trained, client_state)

    def personal_loss(self, fwd, params, x, y, payload, client_state):
        if self.opt.alpha_mode == "fixed":
            return super().personal_loss(fwd, params, x, y, payload, client_state)
        a, w = client_state["apfl.alpha"], strip_prefix(client_state, "apfl.w.")
        _, logits = fwd.call({k: a * p + (1 - a) * w[k] for k, p in params.items()}, x)
        return fwd.cross_entropy(logits, y), {"apfl/alpha": a.detach()}

    def after_personal(self, personal, payload, client_state, report):
        if self.opt.alpha_mode == "adaptive":
            return {**client_state, **add_prefix(personal, "apfl.v.")}
        a, w = self.opt.alpha, strip_prefix(client_state, "apfl.w.")
        v = {k: (personal[k] - (1 - a) * w[k]) / a if w[k].is_floating_point() else personal[k] for k in w}
        return {**client_state, **add_prefix(v, "apfl.v.")}

    def personal_state(self, trained, client_state):
        return self._mix(strip_prefix(client_state, "apfl.v."), trained, client_state)


# ---------------------------------------------------------------------------------------------
# FedALA


def ala_epoch(model_call, start: State, local: State, diff: State, weights: State, batches, eta: float
              ) -> tuple[State, float]:
    """One pass of adaptive local aggregation (FedALA, Zhang et al., AAAI 2023, Eq. 4-6) over
    ``batches`` of (x, y): per batch, the mixed tensors theta_hat = theta + (theta_g - theta) * W
    (``diff`` = theta_g - theta for the tensors in ``weights``; ``start`` gives the others) score
    the training-mode cross-entropy, and W <- clip(W - eta * grad_theta_hat L * (theta_g - theta),
    0, 1). Returns the new W and the last batch's loss (FedALA and FedAH)."""
    loss = torch.zeros(())
    for x, y in batches:
        mixed = {k: (local[k] + diff[k] * w).requires_grad_(True) for k, w in weights.items()}
        _, logits = model_call({**start, **mixed}, x, True)
        loss = F.cross_entropy(logits, y)
        grads = torch.autograd.grad(loss, list(mixed.values()))
        weights = {k: torch.clamp(w - eta * g * diff[k], 0, 1) for (k, w), g in zip(weights.items(), grads)}
    return weights, float(loss.detach())


class FedALAOptions(FedAvgOptions):
    search = {'eta': [0.1, 1.0]}  # the bench's search space (fedskew bench)
    eta: float = Field(1.0, gt=0, description="learning rate of the aggregation weights")
    rand_percent: float = Field(80, gt=0, le=100, description="percent of the local data the weights learn on (s)")
    layer_idx: int = Field(2, ge=0, description="number of last parameter tensors ALA applies to (p; 0: all); "
                                                "lower ones take the global model's values")
    threshold: float = Field(0.1, gt=0, description="first ALA: learn until the std of the last num_pre_loss "
                                                    "epoch losses is below this")
    num_pre_loss: int = Field(10, ge=2, description=
        "how many recent epoch losses the first ALA's stopping test takes the std of")
    max_start_epochs: int = Field(100, ge=1, description="cap on the first ALA's epochs (the official code has none)")


@builtin
class FedALA(Method):
    """FedALA (Zhang et al., AAAI 2023): adaptive local aggregation. Before local training a
    client initialises its model from its previous local model theta and the received global
    model theta_g, element-wise (Eq. 4-5): theta_hat = theta + (theta_g - theta) * W for the last
    ``layer_idx`` parameter tensors (lower ones: theta_g's values), with W in [0, 1] learned on a
    random ``rand_percent`` of the local data (a contiguous slice at a random start, in order,
    full batches of B, as in the official code TsingZ0/FedALA): per batch,
    W <- clip(W - eta * grad_theta_hat L * (theta_g - theta), 0, 1) (Eq. 6). W is kept per client
    across rounds (initially ones). At the client's first ALA it learns until the standard
    deviation of the last ``num_pre_loss`` epoch losses is below ``threshold`` (capped here at
    ``max_start_epochs``), later one epoch. As in the official code, ALA is skipped while the
    global model's first parameter tensor sums to the local one's (the first round). Then FedAvg's
    local training; the locally trained model is uploaded and kept. The loss for W is the
    training-mode forward (BatchNorm statistics of the batch, running statistics not updated).

    Down and up: what FedAvg sends. Keeps a full model and W per client."""

    name = "fedala"
    Options = FedALAOptions
    source = Source(
        authors="Zhang et al.",
        title="FedALA: Adaptive Local Aggregation for Personalized Federated Learning",
        venue="AAAI",
        year=2023,
        arxiv="2212.01197",
        implements="Eq. 4-6 (adaptive local aggregation)",
        code="TsingZ0/FedALA")

    def _ala_names(self) -> list[str]:
        names = list(self.info.param_names)
        return names[-self.opt.layer_idx:] if self.opt.layer_idx else names

    def client_init(self, client_id, global_state, info):
        state = add_prefix({k: v.clone() for k, v in global_state.items()}, "ala.model.")
        state.update({"ala.w." + k: torch.ones_like(global_state[k]) for k in self._ala_names()})
        state["ala.started"] = torch.zeros((), dtype=reference_tensor(global_state).dtype,
                                           device=reference_tensor(global_state).device)
        return state

    def prepare(self, payload, client_state, data: ClientData):
        local, glob = strip_prefix(client_state, "ala.model."), model_part(payload)
        first = self.info.param_names[0]
        if torch.sum(glob[first] - local[first]) == 0:  # the official deactivation test (round 0)
            return client_state
        names = self._ala_names()
        weights = {k: client_state["ala.w." + k].clone() for k in names}
        start = {**glob, **{k: local[k] for k in local if k not in glob}}  # lower layers: the global model's
        n = len(data.y)
        size = int(self.opt.rand_percent / 100 * n)
        b = self.info.batch_size
        batches = size // b
        if batches == 0:
            return {**client_state, **add_prefix(start, "ala.model.")}
        begin = int(numpy_rng(self.info.seed, "fedala", data.round_idx, data.client_id).integers(0, n - size + 1))
        first_time = float(client_state["ala.started"]) == 0
        losses: list[float] = []
        diff = {k: glob[k] - local[k] for k in names}
        rows = [slice(begin + i * b, begin + (i + 1) * b) for i in range(batches)]
        for _ in range(self.opt.max_start_epochs if first_time else 1):
            weights, loss = ala_epoch(self.info.model_call, start, local, diff, weights,
                                      ((data.x[r], data.y[r]) for r in rows), self.opt.eta)
            losses.append(loss)
            if len(losses) > self.opt.num_pre_loss and np.std(losses[-self.opt.num_pre_loss:]) < self.opt.threshold:
                break
        init = {**start, **{k: (local[k] + diff[k] * weights[k]).detach() for k in names}}
        return {**client_state, **add_prefix(init, "ala.model."), **{"ala.w." + k: v for k, v in weights.items()},
                "ala.started": torch.ones_like(client_state["ala.started"])}

    def local_start(self, payload, client_state):
        return strip_prefix(client_state, "ala.model.")

    def after_training(self, trained, payload, client_state, report):
        return as_model_part(trained), {**client_state, **add_prefix(trained, "ala.model.")}


# ---------------------------------------------------------------------------------------------
# FedFOMO


class FedFOMOOptions(FedAvgOptions):
    search = {'M': [3, 5]}  # the bench's search space (fedskew bench)
    M: int = Field(5, ge=1, description="models each selected client downloads (PFLlib's default)")
    epsilon: float = Field(0.3, ge=0, le=1, description="epsilon-greedy: chance of M random models instead of "
                                                        "the top-M by affinity, at round 0")
    epsilon_decay: float = Field(0.05, ge=0, description="epsilon decreases by this every round")
    val_fraction: float = Field(0.2, gt=0, lt=1, description="share of each client's training data held out "
                                                             "as its validation split D_val")


@builtin
class FedFOMO(Method):
    """FedFOMO (Zhang et al., ICLR 2021, Eq. 5-7). No global model: the server keeps the latest
    model of every client (initially the common initial model) and an affinity matrix P (identity
    at first). Each selected client i downloads M other clients' models, chosen epsilon-greedily
    (with probability epsilon_t = epsilon - t * epsilon_decay M uniformly random ones, else the
    top M of P[i]; drawn from the seed), and on its validation split D_val (``val_fraction`` of its
    data, never trained on) weighs each by its first-order gain
    w_n = max(L(theta_i) - L(theta_n), 0) / (||theta_n - theta_i|| + 1e-5), normalised to sum 1
    (all zero: the client keeps its model), and starts from
    theta_i + sum_n w_n (theta_n - theta_i) (Eq. 7; parameters and buffers). Then E epochs of CE on
    its training split; it uploads the trained model and its weights, the server stores the model
    and adds w to P[i] (reference: PFLlib's FedFomo). Losses are eval-mode CE on all of D_val;
    the distance covers the trainable parameters.

    Down: M models + M ids per client; up: the model + M weights + M ids. Keeps: own model (client),
    every client's latest model and P (server: N models). On Flower the M models travel in the
    client's ``download`` record."""

    fedavg_weighted = False  # each client weighs the models it downloads (Method.fedavg_weighted)

    name = "fedfomo"
    Options = FedFOMOOptions
    source = Source(
        authors="Zhang et al.",
        title="Personalized Federated Learning with First Order Model Optimization",
        venue="ICLR",
        year=2021,
        arxiv="2012.08565",
        implements="Eq. 5-7",
        code="NVlabs/FedFomo")
    has_global_model = False
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss)

    @classmethod
    def validation_fraction(cls, options):
        return options.val_fraction

    def _m(self) -> int:
        return min(self.opt.M, self.info.num_clients - 1)

    def server_init(self, global_state, info):
        state = copies(global_state, info.num_clients, "fomo.models.")
        state["fomo.P"] = torch.eye(info.num_clients, dtype=torch.float64)
        return state

    def client_init(self, client_id, global_state, info):
        return add_prefix({k: v.clone() for k, v in global_state.items()}, "fomo.model.")

    def broadcast(self, global_state, server_state):
        return {}

    def download(self, server_state, client_id, round_idx):
        others = np.array([j for j in range(self.info.num_clients) if j != client_id])
        rng = numpy_rng(self.info.seed, "fedfomo", round_idx, client_id)
        eps = max(0.0, self.opt.epsilon - self.opt.epsilon_decay * round_idx)
        if rng.random() < eps:
            chosen = rng.choice(others, size=self._m(), replace=False)
        else:
            affinity = server_state["fomo.P"][client_id, torch.from_numpy(others)].numpy()
            chosen = others[np.argsort(-affinity, kind="stable")[:self._m()]]
        rows = torch.from_numpy(np.asarray(chosen, dtype=np.int64))
        out = {"fomo.cand." + k[len("fomo.models."):]: v[rows] for k, v in server_state.items()
               if k.startswith("fomo.models.")}
        out["fomo.ids"] = rows
        return out

    def prepare(self, payload, client_state, data: ClientData):
        own = strip_prefix(client_state, "fomo.model.")
        cands = strip_prefix(client_state, "fomo.cand.")
        ids = client_state["fomo.ids"]
        m = len(ids)
        weights = torch.zeros(m, dtype=torch.float64)
        if data.y_val is not None and len(data.y_val):
            call = self.info.model_call
            with torch.no_grad():
                own_loss = F.cross_entropy(call(own, data.x_val)[1], data.y_val)
                for n in range(m):
                    other = {k: v[n] for k, v in cands.items()}
                    gain = own_loss - F.cross_entropy(call(other, data.x_val)[1], data.y_val)
                    dist = torch.sqrt(sum((other[k] - own[k]).double().pow(2).sum() for k in self.info.param_names))
                    weights[n] = max(float(gain), 0.0) / (float(dist) + 1e-5)
        if weights.sum() > 0:
            weights = weights / weights.sum()
            own = {k: (v + sum(float(weights[n]) * (cands[k][n] - v) for n in range(m))).to(v.dtype)
                   if v.is_floating_point() else v for k, v in own.items()}
        state = {k: v for k, v in client_state.items() if not k.startswith("fomo.cand.")}
        ref = reference_tensor(own)
        return {**state, **add_prefix(own, "fomo.model."), "fomo.w": weights.to(device=ref.device, dtype=ref.dtype)}

    def local_start(self, payload, client_state):
        return strip_prefix(client_state, "fomo.model.")

    def after_training(self, trained, payload, client_state, report):
        upload = {**as_model_part(trained), "fomo.w": client_state["fomo.w"], "fomo.ids": client_state["fomo.ids"]}
        return upload, add_prefix(trained, "fomo.model.")

    def aggregate(self, server_state, global_state, uploads, reports):
        state = dict(server_state)
        P = state["fomo.P"].clone()
        models = {k: v.clone() for k, v in state.items() if k.startswith("fomo.models.")}
        for u, r in zip(uploads, reports):
            for k, v in model_part(u).items():
                models["fomo.models." + k][r.client_id] = v.to(models["fomo.models." + k].device)
            P[r.client_id, u["fomo.ids"].cpu()] += u["fomo.w"].cpu().double()
        return global_state, {**models, "fomo.P": P}


class FedAMPOptions(FedAvgOptions):
    search = {"sigma": [0.1, 1.0, 10.0], "lam": [None, 0.1, 1.0]}  # the bench's search space (fedskew bench)
    alpha: float | None = Field(None, gt=0, description=
        "alpha_k, the step on the attention regulariser; None: sigma / (N - 1), the largest step for which every xi_ii "
        ">= 0 whatever the distances (u_i a convex combination); PFLlib's default is 1.0")
    sigma: float = Field(1.0, gt=0, description=
        "sigma of A(x) = 1 - exp(-x / sigma), so A'(x) = exp(-x / sigma) / sigma (PFLlib's default)")
    lam: float | None = Field(None, ge=0, description=
        "lambda: the local proximal weight is lambda / (2 alpha); None: lambda = alpha (weight 1/2, whatever N); "
        "PFLlib's default is 1.0")


@builtin
class FedAMP(Method):
    """FedAMP (Huang et al., AAAI 2021, "Personalized Cross-Silo Federated Learning on Non-IID
    Data", Eq. 5-7). No global model: every client trains its own model w_i; the server keeps the
    latest model of every client (trainable parameters) and, for each selected client, passes
    attentive messages: u_i = sum_j xi_ij w_j with xi_ij = alpha A'(||w_i - w_j||^2) for j != i,
    A'(x) = exp(-x / sigma) / sigma (A(x) = 1 - exp(-x / sigma)), and xi_ii = 1 - sum_{j != i} xi_ij
    (Eq. 5, a gradient step of alpha on the regulariser sum_{i<j} A(||w_i - w_j||^2)). The client
    downloads its cloud model u_i and trains its own model, from where it stopped, on
    CE + lambda / (2 alpha) ||w - u_i||^2 over the trainable parameters, every batch (Eq. 7, the
    proximal step), and uploads it. j runs over the other clients the server has a trained model of
    (the paper: all clients, each taking part every round; with sampling, each one's latest model);
    never-trained clients are the common initial model. ``fedamp/self_weight`` logs xi_ii: near 1,
    the attention is negligible and FedAMP is local training with a proximal pull to the round's
    start; below 0, u_i extrapolates away from the peers.

    Defaults: alpha = sigma / (N - 1) keeps u_i a convex combination (A' <= 1 / sigma), and lambda = alpha a proximal
    weight of 1/2 at any N. PFLlib's alphaK = lamda = sigma = 1 gave xi_ii near -3 on digits (docs/methods.md has the
    runs). Where the references differ: PFLlib's client adds lambda / (2 alpha) ||w - u|| (a norm, not its square) on
    detached tensors, so its proximal term has no gradient, and its server mixes the previous round's uploads only;
    fluke's mixes the round's uploads after training and takes alpha = the learning rate in the client's term. Both are
    read, neither copied; the paper's equations are followed. The paper's heuristic variant for deep models (HeurFedAMP,
    cosine similarity) is not built.

    Down: u_i (the trainable parameters) and xi_ii. Up: the model. Keeps: its own model (client);
    every client's latest parameters (server: N models). On Flower u_i travels in the client's
    ``download`` record."""

    fedavg_weighted = False  # the server mixes per client by attention (Method.fedavg_weighted)

    name = "fedamp"
    Options = FedAMPOptions
    source = Source(
        authors="Huang et al.",
        title="Personalized Cross-Silo Federated Learning on Non-IID Data",
        venue="AAAI",
        year=2021,
        arxiv="2007.03797",
        implements="Eq. 5-7",
        code="no official code; PFLlib's serveramp.py and fluke's fedamp.py read")
    has_global_model = False
    per_sample_loss = True  # Method.padding_exact: CE + a term of the parameters alone

    def alpha(self) -> float:
        return self.opt.alpha if self.opt.alpha is not None else self.opt.sigma / max(self.info.num_clients - 1, 1)

    def prox_weight(self) -> float:
        """lambda / (2 alpha) (Eq. 7)."""
        return 0.5 if self.opt.lam is None else self.opt.lam / (2 * self.alpha())

    def server_init(self, global_state, info):
        state = copies({k: global_state[k] for k in info.param_names}, info.num_clients, "amp.models.")
        state["amp.seen"] = torch.zeros(info.num_clients, dtype=torch.bool)
        return state

    def client_init(self, client_id, global_state, info):
        return add_prefix({k: v.clone() for k, v in global_state.items()}, "amp.model.")

    def broadcast(self, global_state, server_state):
        return {}

    def download(self, server_state, client_id, round_idx):
        models = strip_prefix(server_state, "amp.models.")
        xi = attention_weights(models, server_state["amp.seen"], client_id, self.alpha(), self.opt.sigma)
        out = {"amp.u." + k: torch.einsum("n,n...->...", xi.to(v.dtype), v) for k, v in models.items()}
        out["amp.self_weight"] = xi[client_id].to(reference_tensor(models).dtype)
        return out

    def local_start(self, payload, client_state):
        return strip_prefix(client_state, "amp.model.")

    def local_loss(self, fwd, params, x, y, payload, client_state):
        loss, aux = super().local_loss(fwd, params, x, y, payload, client_state)
        prox = sum((p - client_state["amp.u." + k]).pow(2).sum() for k, p in params.items())
        return (loss + self.prox_weight() * prox,
                {**aux, "fedamp/prox": prox.detach(), "fedamp/self_weight": client_state["amp.self_weight"]})

    def after_training(self, trained, payload, client_state, report):
        return as_model_part(trained), add_prefix(trained, "amp.model.")

    def aggregate(self, server_state, global_state, uploads, reports):
        state = {k: v.clone() for k, v in server_state.items()}
        for u, r in zip(uploads, reports):
            for k in self.info.param_names:
                state["amp.models." + k][r.client_id] = u["model." + k].to(state["amp.models." + k].device)
            state["amp.seen"][r.client_id] = True
        return global_state, state


def attention_weights(models: State, seen: torch.Tensor, i: int, alpha: float, sigma: float) -> torch.Tensor:
    """FedAMP's row xi_i. of Eq. 5 (float64): xi_ij = alpha exp(-||w_i - w_j||^2 / sigma) / sigma for
    every other client j with ``seen[j]``, 0 for the rest, and xi_ii = 1 - sum_{j != i} xi_ij.
    ``models`` maps a parameter name to the stacked [N, ...] parameters of all N clients."""
    sq = sum(torch.linalg.vector_norm((v - v[i]).flatten(1), dim=1, dtype=torch.float64) ** 2 for v in models.values())
    xi = alpha * torch.exp(-sq / sigma) / sigma
    peers = seen.to(xi.device).clone()
    peers[i] = False
    xi = torch.where(peers, xi, torch.zeros_like(xi))
    xi[i] = 1.0 - xi.sum()
    return xi


class FedDBEOptions(FedAvgOptions):
    search = {"kl_weight": [0.5, 5.0, 50.0]}  # the bench's search space (fedskew bench)
    kl_weight: float = Field(50.0, ge=0, description=
        "kappa, weight of the mean regularisation (MR) 0.5 mean_j (mean_batch z_j - global mean_j)^2; the authors' "
        "run_me.sh uses 50 (PFLlib's argparse default 0 turns MR off)")


@builtin
class FedDBE(PartialSharing):
    """FedDBE, FedAvg + domain bias eliminator (Zhang et al., NeurIPS 2023, "Eliminating Domain Bias
    for Federated Learning in Representation Space"; TsingZ0/DBE ``clientDBE.py``,
    ``serverDBE.py``, ``run_me.sh``, the same code as PFLlib's ``clientdbe.py``). Each client keeps
    a personalised representation bias (PRBM) mu_k, a trainable vector added to the features before
    the classifier (``FedDBE.build_model``: logits = W (z + mu_k) + b), and trains
    it with the model on CE(W (z + mu_k) + b, y) + kappa * 0.5 mean_j (zbar_j - zbar^g_j)^2 (the run's
    SGD; the authors' client steps mu_k with its own plain SGD at the same lr, no momentum), the
    mean regularisation (MR) pulling the batch's mean feature zbar (before mu_k) to the global
    mean zbar^g. The model without mu_k is sent and averaged as FedAvg's; mu_k never leaves the
    client (zeros at first). Personalised model: the trained model with mu_k; global model: without.

    The global mean: the authors compute it once, before round 0, from an extra local-training
    pass of every client (an "initialization period" whose models are discarded), as the clients'
    sample-weighted last-batch feature means. fedskew folds that period into round 0: round 0
    trains head(z) without MR and without mu_k (which stays 0, as the authors' client leaves it
    out until a global mean exists), each client also sends its mean feature over its local training data (d
    floats, eval mode, after training), the server keeps their sample-weighted mean, and MR is on
    from round 1 (only round 0's clients contribute when clients are sampled). Their running mean
    with ``-mo 1`` (their script's) is the batch mean used here; an EMA across steps (mo < 1) is not
    built. mu_k trains with the run's optimizer (their separate optimizer has no momentum).

    Down: the model without mu_k, and the global mean (d). Up: the model without mu_k (+ d in
    round 0). Keeps mu_k (d floats) per client."""

    name = "feddbe"
    Options = FedDBEOptions
    source = Source(
        authors="Zhang et al.",
        title="Eliminating Domain Bias for Federated Learning in Representation Space",
        venue="NeurIPS",
        arxiv="2311.14975", year=2023,
        implements="the personalised representation bias memory and the mean regulariser (the paper's Section 4)",
        code="TsingZ0/DBE")
    keep = "dbe."

    @classmethod
    def build_model(cls, model, options, rebuild):
        """The PRBM: a trainable vector added to the features before the classifier, zeros as the
        official client_mean starts (logits = W (z + mu_k) + b)."""
        model.shift = nn.Parameter(torch.zeros(model.feature_dim))
        return model

    def shared(self, key):
        return key != "shift"

    def broadcast(self, global_state, server_state):
        payload = super().broadcast(global_state, server_state)
        if "dbe.global_mean" in server_state:
            payload["dbe.global_mean"] = server_state["dbe.global_mean"]
        return payload

    def local_loss(self, fwd, params, x, y, payload, client_state):
        """CE(W (z + mu_k) + b, y) + kappa * 0.5 mean_j (zbar_j - zbar^g_j)^2 (DBE's MR; from the
        round after the global mean is known: the phase is in the payload's keys)."""
        z, logits = fwd(x)
        if "dbe.global_mean" not in payload:
            # the authors' initialisation period: head(rep), mu_k left out (clientDBE.train), so it stays 0
            return fwd.cross_entropy(fwd.head(z), y), {}
        loss = fwd.cross_entropy(logits, y)
        mr = 0.5 * (z.mean(0) - payload["dbe.global_mean"]).pow(2).mean()
        return loss + self.opt.kl_weight * mr, {"dbe/mr": mr.detach()}

    def after_training(self, trained, payload, client_state, report):
        upload, kept = super().after_training(trained, payload, client_state, report)
        if "dbe.global_mean" not in payload:  # round 0: the client's mean feature, for the global mean
            z, _ = report.local_features(trained)
            upload["dbe.mean"] = z.mean(0)
        return upload, kept

    def aggregate(self, server_state, global_state, uploads, reports):
        new, server_state = super().aggregate(server_state, global_state, [
            {k: v for k, v in u.items() if k != "dbe.mean"} for u in uploads], reports)
        if "dbe.mean" in uploads[0]:
            n = torch.tensor([r.num_samples for r in reports], dtype=torch.float64)
            mean = sum(w * u["dbe.mean"].double() for w, u in zip((n / n.sum()).tolist(), uploads))
            server_state = {**server_state, "dbe.global_mean": mean.to(uploads[0]["dbe.mean"].dtype)}
        return new, server_state


class FLDAOptions(FedAvgOptions):
    loss: Literal["code", "single", "both"] = Field(
        "code",
        description="code: CE of the mixture counted twice, as the MAP authors' FLDANet returns it as both "
        "of its outputs (their MAP Table II runs); single: CE of the mixture once; both: CE of the "
        "mixture + CE of the global model's own logits (the two-output form of that code's template)",
    )


@builtin
class FLDA(PartialSharing):
    """FLDA, federated learning with domain adaptation (Peterson, Kanani and Marathe, 2019), in the
    form of the MAP authors' code (the implementation behind MAP Table II): each client mixes the global model's logits
    with those of a private model of the same architecture through a gate on the global model's features, logits =
    alpha(z) g(x) + (1 - alpha(z)) p_k(x) with alpha(z) = sigmoid(w_k^T z + b_k) (``FLDA.build_model``,
    :class:`PrivateExpertNet`), and trains the three jointly on the mixture's cross-entropy (``loss=code``: counted
    twice, see the option; ``loss=both`` adds the global model's own cross-entropy, so that g also learns as a
    classifier by itself rather than only through alpha). Only the global model is sent and averaged (FedAvg weights);
    the private model and the gate stay on the client (the private model starts from its own initialisation, the same
    for every client). Personalised model: the mixture; global model: the averaged g alone. The MAP code tests the
    personalised model on 0.5 (softmax + softmax) of the mixture, the same argmax.

    Sends what FedAvg does; keeps a second model and d + 1 gate weights per client."""

    name = "flda"
    Options = FLDAOptions
    source = Source(
        authors="Peterson, Kanani, Marathe",
        title="Private Federated Learning with Domain Adaptation",
        venue="NeurIPS 2019 workshop on federated learning",
        arxiv="1912.06733", year=2019,
        implements="the gated mixture of the global and a private model",
        code="lxcnju/FedRepo (the MAP authors' FLDA, the implementation behind MAP Table II)")
    keep = "flda."
    per_sample_loss = True  # Method.padding_exact

    @classmethod
    def build_model(cls, model, options, rebuild):
        """A private model of the same configuration (drawn next) and the gate mixing the two
        models' logits (:class:`~fedskew.models.nets.PrivateExpertNet`); both stay on the clients."""
        return PrivateExpertNet(model, rebuild())

    def shared(self, key):
        return not key.startswith(("private.", "gate"))

    def client_init(self, client_id, global_state, info):
        state = super().client_init(client_id, global_state, info)
        return {**state, self.keep + "gate_on": torch.ones_like(state[self.keep + "gate_on"])}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, logits = fwd(x)  # the mixture (the client's gate is on)
        ce = fwd.cross_entropy(logits, y)
        if self.opt.loss == "single":
            return ce, {}
        if self.opt.loss == "code":
            return 2 * ce, {}
        own = fwd.cross_entropy(fwd.head(z), y)  # the global model's classifier on its own features
        return ce + own, {"flda/global_ce": own.detach()}




# ---------------------------------------------------------------------------------------------
# FedAS


class FedASOptions(FedAvgOptions):
    search = {"align_lr": [0.001, 0.01, 0.1]}  # the bench's search space (fedskew bench)
    align_lr: float = Field(0.01, ge=0, description="SGD learning rate of the parameter alignment (the official 0.01)")
    align_epochs: int = Field(1, ge=0, description="epochs of the alignment over the client's data (the official 1)")
    align_batch_size: int = Field(16, ge=1, description="batch size of the prototypes and of the alignment (the "
                                                        "official 16)")
    align_target: Literal["samples", "class_mean"] = Field(
        "samples", description="samples: MSE of every sample's feature to its class prototype (PFLlib's clientas, the "
                               "authors' code); class_mean: MSE of the batch's class-mean feature (FL-bench's fedas)")


@builtin
class FedAS(Method):
    """FedAS (Yang et al., CVPR 2024, "FedAS: Bridging Inconsistency in Personalized Federated
    Learning"; reference PFLlib's ``clientas.py`` and ``serveras.py``). Each client keeps its own
    model; the body is replaced every round, the head (``classifier.*``) stays the client's.

    Parameter alignment (before local training, on the client): the class prototypes of its own
    model's body over its training data (eval mode, no gradient) are the targets; the received
    global body is trained to them by plain SGD (``align_lr``, no momentum, ``align_epochs``
    passes over the data in full batches of ``align_batch_size`` in a seeded order) on
    sum_{c in batch} MSE(z_global(x_{y=c}), prototype_c), and the aligned body replaces the
    client's (parameters; its buffers stay). Then E epochs of CE on the whole model, which is the
    personalised model and is uploaded whole. Client synchronisation (after training): the trace
    of the empirical Fisher information, sum over the full batches of B (stored order, eval mode) of
    ||grad_theta mean_batch NLL||^2 over all parameters, is uploaded with the model, and the
    server's model is the trace-weighted mean of the uploads, F_k / sum F (parameters and
    buffers; the official code keeps the first upload's buffers). The official code also computes
    the trace of every unselected client each round, for its log only: not done here.

    No global model is scored: the server's model is a by-product whose body every client
    receives and whose head (the trace-weighted mean of the clients' heads) no client uses (the
    official code evaluates the personalised models only).

    Down: the model. Up: the model + 1 float. Keeps: its own model (client)."""

    fedavg_weighted = False  # Fisher-trace weights (Method.fedavg_weighted)

    name = "fedas"
    Options = FedASOptions
    source = Source(
        authors="Yang et al.",
        title="FedAS: Bridging Inconsistency in Personalized Federated Learning",
        venue="CVPR",
        year=2024,
        implements="parameter alignment and Fisher-weighted aggregation (the paper's Section 4)",
        code="PFLlib's clientas.py and serveras.py (no official code found)")
    has_global_model = False  # the Fisher-weighted mean's head is nobody's: its body is what clients use
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss)

    def client_init(self, client_id, global_state, info):
        return add_prefix({k: v.clone() for k, v in global_state.items()}, "as.model.")

    def prepare(self, payload, client_state, data: ClientData):
        own, glob = strip_prefix(client_state, "as.model."), model_part(payload)
        body = sorted(body_names(self.info))
        rng = numpy_rng(self.info.seed, "fedas_align", data.round_idx, data.client_id)
        protos = own_prototypes(data.frozen, own, data.x, data.y, self.opt.align_batch_size)
        aligned = align_body(self.info.model_call, glob, body, protos, data.x, data.y, self.opt.align_lr,
                             self.opt.align_epochs, self.opt.align_batch_size, rng, self.opt.align_target)
        return {**client_state, **add_prefix({**own, **aligned}, "as.model.")}

    def local_start(self, payload, client_state):
        return strip_prefix(client_state, "as.model.")

    def after_training(self, trained, payload, client_state, report):
        x, y = report.local_data()
        fim = fisher_trace(self.info.model_call, trained, self.info.param_names, x, y, self.info.batch_size)
        ref = reference_tensor(trained)
        return ({**as_model_part(trained), "as.fim": torch.tensor(fim, dtype=ref.dtype, device=ref.device)},
                add_prefix(trained, "as.model."))

    def aggregate(self, server_state, global_state, uploads, reports):
        fim = torch.stack([u["as.fim"].double() for u in uploads])
        w = fim / fim.sum() if fim.sum() > 0 else torch.full_like(fim, 1 / len(fim))  # (all zero: uniform)
        return weighted_mean([model_part(u) for u in uploads], w), server_state


def own_prototypes(frozen, state: State, x: torch.Tensor, y: torch.Tensor, batch: int) -> dict[int, torch.Tensor]:
    """FedAS's targets: each class's mean feature of the client's own model over its data (eval mode)."""
    z = torch.cat([frozen(state, x[i:i + batch])[0] for i in range(0, len(x), batch)])
    means, counts = class_feature_means(z, y, int(y.max()) + 1)
    return {c: means[c] for c in range(len(counts)) if counts[c] > 0}


def align_body(model_call, glob: State, body: list[str], protos: dict[int, torch.Tensor], x: torch.Tensor,
               y: torch.Tensor, lr: float, epochs: int, batch: int, rng, target: str = "samples") -> State:
    """FedAS's parameter alignment: plain SGD on the global model's body parameters ``body`` of
    sum_{c in batch} MSE(z(x_c), protos[c]) (the mean over the class's rows and features; with
    ``target="class_mean"`` of the class's mean feature), train-mode forward, ``epochs`` passes in
    full batches of ``batch`` (order from ``rng``). Returns the body."""
    params = {k: glob[k].detach().clone() for k in body}
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(len(y))).to(y.device)
        for part in full_batches(len(y), batch):
            rows = order[part]
            xb, yb = x[rows], y[rows]
            live = {k: v.requires_grad_(True) for k, v in params.items()}
            z, _ = model_call({**glob, **live}, xb, True)
            feats = [(z[yb == c].mean(0, keepdim=True) if target == "class_mean" else z[yb == c], protos[int(c)])
                     for c in torch.unique(yb)]
            loss = sum(F.mse_loss(f, p.expand_as(f)) for f, p in feats)
            grads = torch.autograd.grad(loss, [live[k] for k in body])
            params = {k: (live[k] - lr * g).detach() for k, g in zip(body, grads)}
    return params


def full_batches(n: int, batch: int) -> list[slice]:
    """The official loaders' batches (``drop_last=True``): full batches only; all rows when fewer."""
    return [slice(i, i + batch) for i in range(0, n - batch + 1, batch)] or [slice(0, n)]


def fisher_trace(model_call, state: State, names, x: torch.Tensor, y: torch.Tensor, batch: int) -> float:
    """FedAS's client weight (client synchronisation): sum over the full batches of the data, in
    its stored order, of ||grad_theta mean_batch(-log softmax(f(x))_y)||^2 over the parameters
    ``names``, eval mode (the trace of the empirical Fisher information as the official code sums
    it, over a shuffled ``drop_last`` loader)."""
    names = list(names)
    total = 0.0
    for rows in full_batches(len(y), batch):
        live = {k: state[k].detach().clone().requires_grad_(True) for k in names}
        _, logits = model_call({**state, **live}, x[rows], False)
        nll = -F.log_softmax(logits, dim=1).gather(1, y[rows][:, None]).mean()
        total += sum(float(g.double().pow(2).sum()) for g in torch.autograd.grad(nll, [live[k] for k in names]))
    return total


__all__ = ["APFL", "FLDA", "FedALA", "FedAMP", "FedAS", "FedBN", "FedDBE", "FedFOMO", "FedPer", "LGFedAvg",
           "PartialSharing", "align_body", "attention_weights", "fisher_trace", "layer_names", "own_prototypes"]


class FedCACOptions(FedAvgOptions):
    search = {"tau": [0.3, 0.5, 0.7], "beta": [20, 100]}  # the bench's search space (fedskew bench)
    tau: float = Field(0.5, gt=0, le=1, description="share of each layer's parameters that are critical (the largest "
                                                    "|Delta theta * theta|)")
    beta: int = Field(100, ge=1, description="the collaboration threshold rises from the mean overlap to the largest "
                                             "by (t + 1) / beta per round t")


def critical_masks(start: State, trained: State, names, tau: float) -> State:
    """FedCAC's critical parameters of each layer (Wu et al., Sec. 3.2; Fling's
    ``evaluate_critical_parameter``): c = |(theta - theta_start) * theta|; the int(tau n) largest of
    a layer's n entries are critical (c >= the smallest of them; if that is <= 1e-10, the smallest
    c above 1e-20 is the threshold instead). 1 marks a critical entry."""
    out = {}
    for n in names:
        c = ((trained[n] - start[n]) * trained[n]).abs()
        metric = c.reshape(-1)
        k = int(tau * metric.numel())
        # the k-th largest (topk(metric, k).values[-1], by selection: a quarter of topk's time)
        thresh = torch.kthvalue(metric, metric.numel() - k + 1).values if k > 0 else torch.tensor(float("inf"))
        if thresh <= 1e-10:
            nonzero = metric[metric > 1e-20]
            if len(nonzero):
                thresh = nonzero.min()
        out[n] = (c >= thresh).to(trained[n].dtype)
    return out


def overlap_matrix(masks: torch.Tensor) -> torch.Tensor:
    """overlap[i, j] = 1 - sum |m_i - m_j| / (2 sum m_i) of clients' flattened critical masks (rows).
    For 0/1 masks sum |m_i - m_j| = sum m_i + sum m_j - 2 m_i . m_j, integers that float64 holds
    exactly (the pairwise difference tensor was clients^2 x parameters floats)."""
    m = masks.double()
    sums = m.sum(1)
    diff = (sums[:, None] + sums[None, :] - 2 * (m @ m.T)).to(masks.dtype)
    return 1 - diff / (2 * masks.sum(1, keepdim=True))


@builtin
class FedCAC(Method):
    """FedCAC (Wu, Liu, Niu, Zhu, Tang, ICCV 2023): each client marks the critical share tau of each
    layer's parameters (``critical_masks``) after its local training and uploads the model with the
    mask. The server averages FedAvg's global model, and for every client of the round a customised
    model: the plain mean of the trained models of it and of the round's clients whose masks overlap
    its own by at least the threshold mean + (t + 1) / beta (max - mean) (``overlap_matrix``; round t
    counted from 0, so collaboration narrows as training goes on). A client starts its next round from
    its critical parameters taken from its customised model and the others from the global model
    (``local_start``). The personalised model is the trained one (Fling's 'before aggregation'); the
    final pass starts from the mixture (its 'after aggregation')."""

    name = "fedcac"
    Options = FedCACOptions
    source = Source(authors="Wu, Liu, Niu, Zhu, Tang",
                    title="Bold but Cautious: Unlocking the Potential of Personalized Federated Learning through "
                          "Cautiously Aggressive Collaboration",
                    venue="ICCV", year=2023, arxiv="2309.11103",
                    implements="Sec. 3 (critical parameter selection, overlap threshold, customised global models)",
                    code="kxzxvbk/Fling fling/component/client/fedcac_client.py, group/fedcac_group.py, "
                         "flzoo/cifar10/cifar10_fedcac_resnet_config.py (tau 0.5, beta 100); PFLlib servercac.py")
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss)

    def server_init(self, global_state, info):
        state = copies(global_state, info.num_clients, "cac.custom.")
        return {**state, "cac.round": torch.zeros((), dtype=torch.long)}

    def client_init(self, client_id, global_state, info):
        # no critical entry before the first training: the first round starts from the global model
        return {"cac.mask." + k: torch.zeros_like(global_state[k]) for k in info.param_names}

    def download(self, server_state, client_id, round_idx):
        return {"cac.model." + k[len("cac.custom."):]: v[client_id] for k, v in server_state.items()
                if k.startswith("cac.custom.")}

    def local_start(self, payload, client_state):
        glob = model_part(payload)
        custom = strip_prefix(client_state, "cac.model.")
        return {k: g + client_state["cac.mask." + k] * (custom[k] - g) if "cac.mask." + k in client_state else g
                for k, g in glob.items()}

    def after_training(self, trained, payload, client_state, report):
        start = self.local_start(payload, client_state)
        masks = critical_masks(start, trained, self.info.param_names, self.opt.tau)
        return ({**as_model_part(trained), **add_prefix(masks, "cac.critical.")},
                add_prefix(masks, "cac.mask."))

    def aggregate(self, server_state, global_state, uploads, reports):
        new = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        state = {k: v.clone() if k.startswith("cac.custom.") else v for k, v in server_state.items()}
        n, names = len(uploads), self.info.param_names
        together = torch.ones(n, n, dtype=torch.bool)
        if n > 1:
            masks = torch.stack(
                [torch.cat([u["cac.critical." + k].reshape(-1).double() for k in names]) for u in uploads]
            )
            overlap = overlap_matrix(masks)
            off = ~torch.eye(n, dtype=torch.bool)
            mean, top = overlap[off].mean(), overlap[off].max()
            t = int(server_state["cac.round"])
            threshold = mean + (t + 1) / self.opt.beta * (top - mean)
            together = (overlap >= threshold) | ~off
        models = [model_part(u) for u in uploads]
        for i, r in enumerate(reports):
            peers = [models[j] for j in range(n) if together[i, j]]
            custom = weighted_mean(peers, torch.full((len(peers),), 1.0 / len(peers), dtype=torch.float64))
            for k, v in custom.items():
                state["cac.custom." + k][r.client_id] = v
        state["cac.round"] = server_state["cac.round"] + 1
        return new, state


class FedAHOptions(FedAvgOptions):
    search = {"eta": [0.1, 1.0], "head_epochs": [1, 2]}  # the bench's search space (fedskew bench)
    eta: float = Field(1.0, gt=0, description="learning rate of the head's aggregation weights")
    head_epochs: int = Field(1, ge=1, le=10_000, description="epochs of the weight learning and of the head's training "
                                                  "(FL-bench's plocal_epochs)")


@builtin
class FedAH(Method):
    """FedAH (Zhou et al., arXiv 2024; as FL-bench's ``fedah`` runs it): FedALA's adaptive local aggregation
    (:func:`ala_epoch`) applied to the head. Before training, a client mixes its own head theta
    (kept from its last round) with the received global head theta_g element-wise,
    theta + (theta_g - theta) * W, W in [0, 1] learned per batch over ``head_epochs`` passes of its
    data with the received body (``prepare``; W kept across rounds, initially ones). Then it trains
    the head for ``head_epochs`` epochs with the body frozen, then the body for its E epochs with the
    head frozen (``personal_first``). The whole model is uploaded and averaged as FedAvg's; the
    client keeps its trained head."""

    name = "fedah"
    Options = FedAHOptions
    source = Source(
        authors="Zhou, He, Zhai, Gao, Chen, Qin, Zhang, Guo",
        title="FedAH: Aggregated Head for Personalized Federated Learning",
        venue="arXiv preprint",
        year=2024,
        arxiv="2412.01295",
        implements="head aggregation by learned element-wise weights, then head and body training",
        code="KarhouTam/FL-bench src/client/fedah.py, src/server/fedah.py (eta 1.0, plocal_epochs 1); "
        "the authors' code is heyuepeng/FedAH",
    )
    requires_classifier = "linear"
    personal_first = True
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss, both stages)

    def client_init(self, client_id, global_state, info):
        heads = head_names(info)
        return {**{"ah.head." + k: global_state[k].clone() for k in heads},
                **{"ah.w." + k: torch.ones_like(global_state[k]) for k in heads}}

    def prepare(self, payload, client_state, data: ClientData):
        glob, heads = model_part(payload), sorted(head_names(self.info))
        local = {k: client_state["ah.head." + k] for k in heads}
        diff = {k: glob[k] - local[k] for k in heads}
        weights = {k: client_state["ah.w." + k] for k in heads}
        b, n = self.info.batch_size, len(data.y)
        for epoch in range(self.opt.head_epochs):
            order = torch.from_numpy(numpy_rng(self.info.seed, "fedah", data.round_idx, data.client_id, epoch)
                                     .permutation(n))
            batches = ((data.x[order[i:i + b]], data.y[order[i:i + b]]) for i in range(0, n, b))
            weights, _ = ala_epoch(self.info.model_call, glob, local, diff, weights, batches, self.opt.eta)
        mixed = {k: (local[k] + diff[k] * weights[k]).detach() for k in heads}
        return {**client_state, **add_prefix(mixed, "ah.head."), **add_prefix(weights, "ah.w.")}

    def local_start(self, payload, client_state):
        return {**model_part(payload), **strip_prefix(client_state, "ah.head.")}

    def split_steps(self, total_steps, lr):
        head = max(1, round(total_steps * self.opt.head_epochs / max(self.info.local_epochs, 1)))
        return total_steps, head, lr

    def trained_params(self, stage):
        return head_names(self.info) if stage == "personal" else body_names(self.info)

    def after_personal(self, personal, payload, client_state, report):
        return {**client_state, **add_prefix({k: personal[k] for k in head_names(self.info)}, "ah.head.")}
