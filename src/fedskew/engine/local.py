"""The sequential executor (the reference for correctness) and the model-state helpers every
executor shares: the selected clients train one after another with ordinary autograd and
torch.optim.SGD, through the one client-round driver (:func:`fedskew.engine.protocol.client_round`)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedskew.algorithms.base import ClientData, ClientReport, Forward, Method, State
from fedskew.algorithms.tensors import sam_perturbation
from fedskew.data.augment import crop_flip
from fedskew.data.federated import Federation
from fedskew.engine.batched_sgd import FP16_GROWTH_INTERVAL, FP16_INIT_SCALE
from fedskew.engine.protocol import (
    ClientResult,
    Executor,
    LocalSettings,
    StagePlan,
    client_round,
    local_budget,
    make_forward,
)
from fedskew.models.functional import bn_recalibration_fn, feature_fn, frozen_fn, low_precision, predict
from fedskew.models.nets import DROPOUT_MASKS, GeneratorMasks
from fedskew.streams import dropout_generator, torch_seed


def federated_state(model: nn.Module) -> State:
    """The tensors a federation exchanges: parameters and floating-point buffers (BatchNorm running
    statistics). Integer buffers (``num_batches_tracked``) stay local: nothing reads them when BN
    momentum is set, and an average of counters means nothing. Fixed architecture tensors
    (``model.fixed_keys``: the ETF head) are left out: every party builds them from the seed."""
    fixed = getattr(model, "fixed_keys", frozenset())
    out = {k: v.detach().clone() for k, v in model.named_parameters()}
    out.update({k: v.detach().clone() for k, v in model.named_buffers() if v.is_floating_point() and k not in fixed})
    return out


def load_state(model: nn.Module, state: State) -> None:
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    with torch.no_grad():
        for k, v in state.items():
            tensors[k].copy_(v)


def add_tracked(total: dict, tracked: dict) -> dict:
    """Accumulate a step's loss and aux values (detached)."""
    for k, v in tracked.items():
        total[k] = total[k] + v.detach() if k in total else v.detach()
    return total


def join_pairs(x: torch.Tensor, y: torch.Tensor, px: torch.Tensor, py: torch.Tensor, draws: torch.Tensor | None,
               pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of own samples ``x`` [..., b, *shape] joined by their paired samples ``px`` [..., b,
    m, *shape] (``Method.paired_samples``): [..., b (1 + m), *shape], the own first, then slot 1's,
    slot 2's, ...; each paired sample takes its own sample's crop/flip ``draws`` (None: none)."""
    slots = list(px.unbind(y.dim()))  # the slot axis follows the batch axis
    if draws is not None:
        slots = [crop_flip(v, draws, pad) for v in slots]
    d = y.dim() - 1
    return torch.cat([x, *slots], d), torch.cat([y, *py.unbind(y.dim())], d)


def module_forward(model: nn.Module, precision: str = "fp32") -> Forward:
    """The :class:`Forward` of an ``nn.Module`` trained in place (the sequential executor's)."""
    return make_forward(model, dict(model.named_parameters()), dict(model.named_buffers()),
                        low_precision(model, precision), own=True)


class SequentialExecutor(Executor):
    """Trains the selected clients one after another with ordinary autograd and torch.optim.SGD."""

    name = "sequential"
    validates = True
    score_validation = False  # client_round also scores the personal models on the hold-out

    @property
    def sequential(self) -> SequentialExecutor:  # its own retry path
        return self

    def __init__(self, model: nn.Module, fed: Federation, method: Method, settings: LocalSettings,
                 device: torch.device):
        self.model = model
        self.fed = fed
        self.method = method
        self.settings = settings
        self.device = device
        self.x = fed.data.x_train.to(device)
        if settings.channels_last and self.x.dim() == 4:  # NHWC: indexing keeps the layout, so every batch has it
            model.to(memory_format=torch.channels_last)
            self.x = self.x.contiguous(memory_format=torch.channels_last)
        self.y = fed.data.y_train.to(device)
        self.train_idx = [i.to(device) for i in fed.train_idx]
        self.test_idx = [i.to(device) for i in fed.test_idx]
        self.val_idx = [i.to(device) for i in fed.val_idx] if fed.val_idx is not None else None

    # -- StageRunner (fedskew.engine.protocol) -------------------------------------------------------
    def num_samples(self, client_id: int) -> int:
        return len(self.train_idx[client_id])

    def accuracies(self, states: list[State], clients: list[int], rng: tuple[int, int] | None = None
                   ) -> list[float | None]:
        """Each state's accuracy on its client's local test split (None: the split is empty), torch's
        generator seeded per client from (seed, ``local_rng``, round, client, tag) when ``rng``
        = (round, tag) is given (a model random in eval mode: FedCP's policy)."""
        out = []
        for state, k in zip(states, clients):
            if rng is not None:
                torch.manual_seed(torch_seed(self.settings.seed, "local_rng", rng[0], k, rng[1]))
            idx = self.test_idx[k]
            out.append((predict(self.model, state, self.x[idx]) == self.y[idx]).sum().item() / len(idx)
                       if len(idx) else None)
        return out

    def val_accuracies(self, states: list[State], clients: list[int], rng: tuple[int, int] | None = None
                       ) -> list[float | None]:
        """Each state's accuracy on the validation hold-out (``dataset.validation_fraction``,
        carved from the training set before partitioning, so no client trains on it) weighted to
        its client's label distribution: sum_c p_k(c) acc(c), p_k the class frequencies of client
        k's training data over the classes the hold-out has. The client's own test split stays
        out of selection; a personalised model is scored on its own client's classes."""
        data = self.fed.data
        if data.x_val is None:
            return [None] * len(states)
        x, y, c = data.x_val.to(self.device), data.y_val.to(self.device), self.fed.num_classes
        per_class_n = torch.bincount(y, minlength=c).double()
        out = []
        for state, k in zip(states, clients):
            if rng is not None:
                torch.manual_seed(torch_seed(self.settings.seed, "local_rng", rng[0], k, rng[1]))
            hit = torch.bincount(y, weights=(predict(self.model, state, x) == y).double(), minlength=c)
            p = torch.bincount(self.y[self.train_idx[k]], minlength=c).double() * (per_class_n > 0)
            out.append((p * hit / per_class_n.clamp(min=1)).sum().item() / p.sum().item() if p.sum() > 0 else None)
        return out

    def report(self, client_id: int, num_steps: int, lr: float) -> ClientReport:
        idx = self.train_idx[client_id]
        return ClientReport(client_id, len(idx), num_steps, lr, self.settings.sgd_momentum,
                            feature_fn(self.model, self.x, self.y, rows=idx),
                            bn_recalibration_fn(self.model, self.x, self.settings.batch_size, idx),
                            lambda: (self.x[idx], self.y[idx]))

    def prepare(self, round_idx: int, client_id: int, payload: State, client_state: State, lr: float = 0.0) -> State:
        """``Method.prepare`` with the client's local training data, the round's ``lr`` and the
        client's local steps."""
        if type(self.method).prepare is Method.prepare:  # unchanged: no need to gather the data
            return client_state
        idx = self.train_idx[client_id]
        val = self.val_idx[client_id] if self.val_idx is not None else None
        return self.method.prepare(payload, client_state, ClientData(
            client_id, round_idx, self.x[idx], self.y[idx], frozen_fn(self.model),
            None if val is None else self.x[val], None if val is None else self.y[val], lr,
            local_budget(self.settings, self.method, round_idx, client_id, len(idx))[1]))

    def run_stage(self, plan: StagePlan, starts, states, clients, payload, round_idx):
        """Each client in turn: its start state loaded into the one model, a fresh torch.optim.SGD,
        and torch's global generator seeded from the stream (seed, ``local_rng``, round, client,
        stage), so that random layers (dropout) draw the same masks whatever ran before in this
        process: another run of a sweep worker, or the rounds before a resume. Dropout layers
        (``StreamDropout``) draw their masks from the client's own ``dropout`` stream instead."""
        trained, means = [], []
        for i, (start, state, k) in enumerate(zip(starts, states, clients)):
            torch.manual_seed(torch_seed(self.settings.seed, "local_rng", round_idx, k, plan.stream == 1))
            load_state(self.model, start)
            # dropout masks from the client's own stream, as the vectorised executor draws them
            token = DROPOUT_MASKS.set(GeneratorMasks(dropout_generator(self.settings.seed, round_idx, k, plan.stream)))
            try:
                means.append(self._sgd_stage(
                    plan.loss, self.train_idx[k], plan.schedules[i], plan.lrs[i], payload, state, plan.trainable,
                    plan.augment[i] if plan.augment else None, plan.corrections[i] if plan.corrections else None,
                    plan.sam, plan.pairs[i] if plan.pairs else None))
            finally:
                DROPOUT_MASKS.reset(token)
            trained.append(federated_state(self.model))
        return trained, means

    # -- rounds ------------------------------------------------------------------------------------
    def train_round(self, round_idx: int, clients: list[int], payload: State,
                    client_states: dict[int, State], lr: float) -> list[ClientResult]:
        return client_round(self, round_idx, clients, payload, [client_states[k] for k in clients], lr)

    def train_client(self, round_idx: int, client_id: int, payload: State, client_state: State,
                     lr: float) -> ClientResult:
        """One client's round (Flower's ClientApp; the retry of a round that lost a client)."""
        return client_round(self, round_idx, [client_id], payload, [client_state], lr)[0]

    def _sgd_stage(self, loss_fn, idx: torch.Tensor, batches: list[np.ndarray], lr: float,
                   payload: State, client_state: State, trainable: frozenset[str] | None = None,
                   augment: torch.Tensor | None = None, correction: State | None = None, sam=None,
                   pair: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
        """Train the loaded model on ``batches`` with a fresh local optimiser (torch.optim.SGD, Adam or
        AdamW: :meth:`LocalSettings.torch_optimizer`) over the ``trainable``
        parameters (None: all; the others are frozen), each batch augmented with its rows of
        ``augment`` when given, and ``p -= lr * correction[p]`` after every optimizer step
        (``Method.step_correction``); ``sam`` (``Method.sam``): every step takes its gradient at
        w + eps (:func:`sam_perturbation`), as the official FedSAM client's ascent and descent
        steps, w restored exactly before the SGD step; ``pair`` (``Method.paired_samples``): each
        batch joined by its rows of the paired samples. Mean tracked values (of the first pass)."""
        s, model = self.settings, self.model
        model.train()
        params = dict(model.named_parameters())
        updated = [p for k, p in params.items() if trainable is None or k in trainable]
        frozen = [p for k, p in params.items() if trainable is not None and k not in trainable]
        opt = s.torch_optimizer(updated, lr)
        fwd = module_forward(model, s.precision)
        # fp16: dynamic loss scaling, a step with non-finite gradients skipped; else a pass-through
        scaler = torch.amp.GradScaler(
            self.device.type,
            init_scale=FP16_INIT_SCALE,
            growth_interval=FP16_GROWTH_INTERVAL,
            enabled=s.precision == "fp16",
        )
        sums: dict = {}
        for p in frozen:
            p.requires_grad_(False)
        try:
            at = 0
            for positions in batches:
                local = torch.from_numpy(positions).to(self.device)
                rows = idx[local]
                x, y = self.x[rows], self.y[rows]
                if augment is not None:
                    draws = augment[at:at + len(rows)]
                    x = crop_flip(x, draws, s.augment_pad)
                    at += len(rows)
                if pair is not None:
                    x, y = join_pairs(x, y, pair[0][local], pair[1][local],
                                      draws if augment is not None else None, s.augment_pad)
                loss, aux = loss_fn(fwd, params, x, y, payload, client_state)
                opt.zero_grad(set_to_none=True)
                if getattr(sam, "ascent", None) is None:  # (FedSOL's step never reads the gradient at w)
                    scaler.scale(loss).backward()
                if sam is not None:
                    self._sam_gradient(loss_fn, fwd, params, updated, x, y, payload, client_state, sam)
                scaler.unscale_(opt)
                if s.grad_clip is not None:
                    nn.utils.clip_grad_norm_(updated, s.grad_clip)
                scaler.step(opt)
                scaler.update()
                if correction:
                    with torch.no_grad():
                        for k, d in correction.items():
                            if trainable is None or k in trainable:
                                params[k].sub_(d, alpha=lr)
                add_tracked(sums, {"loss": loss, **aux})
        finally:
            for p in frozen:
                p.requires_grad_(True)
        return {k: (v / max(len(batches), 1)).item() for k, v in sums.items()}

    @staticmethod
    def _sam_gradient(loss_fn, fwd, params, updated, x, y, payload, client_state, sam) -> None:
        """Replace the gradients of ``updated`` (at w) by those at w + eps (SAM / ASAM; eps from
        ``sam.ascent``'s gradient by ``sam.perturbation`` where the method gives them: FedSOL)."""
        names = [k for k, p in params.items() if any(p is u for u in updated)]
        ascent = getattr(sam, "ascent", None)
        if ascent is not None:  # eps from another loss's gradient at w (FedSOL's proximal loss)
            a_loss, _ = ascent(fwd, params, x, y, payload, client_state)
            a_grads = torch.autograd.grad(a_loss, [params[k] for k in names], allow_unused=True,
                                          materialize_grads=True)
        with torch.no_grad():
            saved = {k: params[k].detach().clone() for k in names}
            if ascent is None:
                grads = {k: (params[k].grad if params[k].grad is not None else torch.zeros_like(params[k]))[None]
                         for k in names}
                eps = sam_perturbation({k: saved[k][None] for k in names}, grads, sam.rho, sam.adaptive, sam.eta)
            else:
                eps = sam.perturbation({k: saved[k][None] for k in names}, {k: g[None] for k, g in zip(names, a_grads)},
                                       {k: v[None] for k, v in payload.items()})
            for k in names:
                params[k].add_(eps[k][0])
                params[k].grad = None
        loss, _ = loss_fn(fwd, params, x, y, payload, client_state)
        loss.backward()
        with torch.no_grad():
            for k in names:
                params[k].copy_(saved[k])
