"""One client round, the same for every executor (design.md, "Executors").

:func:`client_round` is the only place that says in which order a selected client's round calls the method: ``prepare``
(then ``paired_samples``) -> ``local_start`` -> (``personal_first``: the personalisation stage) -> the uploaded model's
training with ``step_correction`` -> ``after_training`` -> the personalisation stage -> ``personal_state``, with the
local accuracy before and after. Executors differ only in how a stage trains (:class:`StageRunner`): the sequential
executor (and so Flower's ClientApp) one client after another with torch.optim.SGD, the vectorised one all clients
stacked in one ``torch.func`` program. What a stage trains (loss, trainable parameters, schedules, learning rates, the
step correction, SAM, paired samples, crop/flip draws, whether it may be padded) is one :class:`StagePlan` made here and
read by both: a new stage knob is a field and its two readers. :func:`dispatch` is what the server sends a round's
clients (``broadcast`` + ``download``), for the rounds and the final personalisation alike. :func:`make_forward` builds
the :class:`Forward` a method's loss receives, for both executors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
import torch
from torch import nn

from fedskew.algorithms.base import ClientReport, FederationInfo, Forward, Method, State
from fedskew.data.augment import crop_flip_params
from fedskew.models.functional import training_calls
from fedskew.streams import batch_order, straggler_steps

Stage = Literal["upload", "personal"]


@dataclass(frozen=True)
class LocalSettings:
    """Mini-batch training on a client with a fresh optimiser every stage: torch.optim.SGD
    semantics (dampening 0, no Nesterov; weight decay added to the gradient before momentum), or
    torch.optim.Adam / AdamW (``optimizer``; ``betas``, ``eps``); optional clipping of the global
    grad norm."""

    epochs: int
    batch_size: int
    momentum: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float | None = None
    seed: int = 0
    augment_pad: int = 0  # > 0: random crop with this zero padding + horizontal flip of training batches
    precision: str = "fp32"  # fp32 | bf16 | fp16: the training forward's compute dtype (low_precision)
    optimizer: str = "sgd"  # sgd | adam | adamw
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    stragglers: float = 0.0  # the fraction of clients that do fewer local steps in a round (streams.straggler_steps)
    rounds: int | None = None  # the run's rounds: the final personalisation pass (round `rounds`) never straggles
    compile: bool = False  # vectorized: the stacked loss through torch.compile (fedskew.engine.vectorized.compiled)
    channels_last: bool = False  # sequential: the model and image batches in the NHWC layout (SequentialExecutor)

    @property
    def sgd_momentum(self) -> float:
        """The SGD momentum the local steps use (0 with Adam: what ClientReport.momentum tells methods)."""
        return self.momentum if self.optimizer == "sgd" else 0.0

    def torch_optimizer(self, params, lr: float) -> torch.optim.Optimizer:
        """The torch.optim optimiser of these settings (the sequential executor's, the reference)."""
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=self.momentum, weight_decay=self.weight_decay)
        cls = torch.optim.Adam if self.optimizer == "adam" else torch.optim.AdamW
        return cls(params, lr=lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)

    def augmentation(self, round_idx: int, client_id: int, stage: int, n: int) -> torch.Tensor | None:
        """The crop/flip draws of a stage's n samples (None: augmentation off); stage 0 is the
        uploaded model's training, 1 the personalisation stage."""
        if not self.augment_pad:
            return None
        return crop_flip_params(self.seed, round_idx, client_id, stage, n, self.augment_pad)


@dataclass
class ClientResult:
    client_id: int
    upload: State
    client_state: State
    report: ClientReport
    train_loss: float
    acc_before: float | None = None
    acc_after: float | None = None
    aux: dict = field(default_factory=dict)
    val_after: float | None = None  # the personal model on the validation hold-out (when scored)


def batch_schedule(settings: LocalSettings, round_idx: int, client_id: int, n: int,
                   epochs: int | None = None) -> list[np.ndarray]:
    """The client's mini-batches for the round, as positions into its local index set: one fresh
    permutation per epoch (stream ``batch_order``), cut into batches of B; the last batch of an
    epoch may be smaller (no sample is dropped)."""
    batches = []
    for perm in batch_order(settings.seed, round_idx, client_id, n, settings.epochs if epochs is None else epochs):
        batches += [perm[i:i + settings.batch_size] for i in range(0, n, settings.batch_size)]
    return batches


def local_budget(settings: LocalSettings, method: Method, round_idx: int, client_id: int, n: int) -> tuple[int, int]:
    """A client's local steps in a round (both stages): its budget (``Method.local_steps`` of E
    epochs over its ``n`` samples) and what it does, fewer when it straggles
    (:func:`~fedskew.streams.straggler_steps`; never in the final personalisation pass)."""
    per_epoch = math.ceil(n / settings.batch_size)
    budget = method.local_steps(round_idx, settings.epochs * per_epoch, per_epoch)
    if settings.stragglers and (settings.rounds is None or round_idx < settings.rounds):
        return budget, straggler_steps(settings.seed, round_idx, client_id, settings.stragglers, budget)
    return budget, budget


def stage_schedules(settings: LocalSettings, method: Method, round_idx: int, client_id: int,
                    n: int, lr: float) -> tuple[list[np.ndarray], list[np.ndarray], float]:
    """The batches of the uploaded model's training and of the personalisation stage (if the
    method has one; the round's step budget is ``Method.local_steps``, cut for a straggler),
    consecutive on the client's batch stream in the order the stages run, and the latter's
    learning rate."""
    per_epoch = math.ceil(n / settings.batch_size)
    steps_a, steps_b, lr_b = method.split_steps(local_budget(settings, method, round_idx, client_id, n)[1], lr)
    batches = batch_schedule(settings, round_idx, client_id, n, math.ceil((steps_a + steps_b) / max(per_epoch, 1)))
    if method.personal_first:
        return batches[steps_b:steps_a + steps_b], batches[:steps_b], lr_b
    return batches[:steps_a], batches[steps_a:steps_a + steps_b], lr_b


def stage_loss(method: Method, stage: Stage | Literal["ascent"]) -> Callable:
    """The loss a stage trains: ``Method.local_loss`` (the uploaded model) or ``personal_loss``;
    ``ascent``: the loss whose gradient gives a sharpness-aware step's eps (``Method.sam.ascent``)."""
    if stage == "ascent":
        return method.sam.ascent
    return method.local_loss if stage == "upload" else method.personal_loss


@dataclass(frozen=True)
class StagePlan:
    """One stage of a round's clients as every executor trains it (made by :func:`plan_stage`):
    each client in turn from its start state (the sequential executor) or all of them stacked (the
    vectorised one) do local SGD on ``loss`` over their ``schedules`` at ``lrs``."""

    stage: Stage
    loss: Callable  # stage_loss(method, stage)
    trainable: frozenset[str] | None  # Method.trained_params(stage); None: every parameter
    schedules: list[list[np.ndarray]]  # each client's batches (positions into its training rows)
    lrs: list[float]
    corrections: list[State] | None  # each client's Method.step_correction, applied after every step; None: none
    sam: object | None  # Method.sam (upload stage): each step's gradient taken at w + eps
    pairs: list | None  # each client's Method.paired_samples (joined to every batch); None: none
    augment: list[torch.Tensor] | None  # each client's crop/flip draws of the stage's samples; None: off

    @property
    def stream(self) -> int:
        """The stage's index in the per-client random streams (crop/flip, dropout, torch's generator)."""
        return 0 if self.stage == "upload" else 1

    @property
    def paddable(self) -> bool:
        """Whether a stacked step may pad short batches with zero-weight rows (not with paired samples)."""
        return self.pairs is None


def plan_stage(method: Method, settings: LocalSettings, stage: Stage, clients: list[int], states: list[State],
               schedules: list[list[np.ndarray]], lrs: list[float], payload: State, round_idx: int,
               pairs: list | None) -> StagePlan:
    """The :class:`StagePlan` of ``stage`` for ``clients`` (their prepared ``states``)."""
    corrections = None
    if stage == "upload":
        corrections = [method.step_correction(payload, st) for st in states]
        if all(c is None for c in corrections):
            corrections = None
    augment = None
    if settings.augment_pad:
        stream = 0 if stage == "upload" else 1
        augment = [settings.augmentation(round_idx, k, stream, sum(map(len, sc))) for k, sc in zip(clients, schedules)]
    return StagePlan(stage, stage_loss(method, stage), method.trained_params(stage), schedules, list(lrs),
                     corrections, method.sam if stage == "upload" else None, pairs, augment)


def make_forward(model: nn.Module, params: State, buffers: State, cast_dtype=None, weights=None,
                 own: bool = False) -> Forward:
    """The :class:`Forward` of ``model`` with ``params`` and ``buffers`` (both executors' training
    forward; :func:`~fedskew.models.functional.training_calls`)."""
    c = training_calls(model, params, buffers, cast_dtype, own)
    return Forward(c.train, c.frozen, c.head, c.call, buffers, c.evaluate, weights)


class StageRunner(Protocol):
    """How an executor trains: what :func:`client_round` needs besides the method."""

    method: Method
    settings: LocalSettings

    def num_samples(self, client_id: int) -> int:
        """The client's number of local training samples."""

    def prepare(self, round_idx: int, client_id: int, payload: State, client_state: State, lr: float) -> State:
        """``Method.prepare`` with the client's data (and the round's ``lr`` and its local steps)."""

    def report(self, client_id: int, num_steps: int, lr: float) -> ClientReport:
        """The client's :class:`ClientReport` for a round of ``num_steps`` uploaded-model steps."""

    def accuracies(self, states: list[State], clients: list[int], rng: tuple[int, int]) -> list[float | None]:
        """Each state's accuracy on its client's local test split (None: the split is empty);
        ``rng`` (round, tag) seeds torch's generator per client where a model draws random numbers
        in eval mode (FedCP's policy), so that the score does not depend on what ran before."""

    def val_accuracies(self, states: list[State], clients: list[int], rng: tuple[int, int]) -> list[float | None]:
        """Each state's accuracy on the validation hold-out, weighted to its client's label
        distribution (None: no hold-out); asked for when the runner's ``score_validation`` is set."""

    def run_stage(self, plan: StagePlan, starts: list[State], states: list[State], clients: list[int],
                  payload: State, round_idx: int) -> tuple[list[State], list[dict[str, float]]]:
        """Local SGD of each client from its start state as ``plan`` says: the trained states
        (parameters and float buffers) and each client's mean tracked values (``loss`` and aux)."""


def client_round(runner: StageRunner, round_idx: int, clients: list[int], payload: State,
                 client_states: list[State], lr: float) -> list[ClientResult]:
    """One round of local work of ``clients`` (in that order), whatever the executor."""
    method, settings = runner.method, runner.settings
    states = [runner.prepare(round_idx, k, payload, st, lr) for k, st in zip(clients, client_states)]
    pairs = [None] * len(clients)
    for i, st in enumerate(states):
        pairs[i], states[i] = method.paired_samples(st)
    if all(p is None for p in pairs):
        pairs = None
    starts = [method.local_start(payload, st) for st in states]
    acc_before = runner.accuracies(starts, clients, (round_idx, 2))
    plans = [stage_schedules(settings, method, round_idx, k, runner.num_samples(k), lr) for k in clients]
    reports = [runner.report(k, len(plan[0]), lr) for k, plan in zip(clients, plans)]
    aux: list[dict] = [{} for _ in clients]
    has_personal = any(plan[1] for plan in plans)

    def personal_stage(begin_from: list[State], states: list[State]) -> list[State]:
        begin = [method.personal_start(t, payload, st) for t, st in zip(begin_from, states)]
        plan = plan_stage(method, settings, "personal", clients, states, [p[1] for p in plans], [p[2] for p in plans],
                          payload, round_idx, pairs)
        personal, means = runner.run_stage(plan, begin, states, clients, payload, round_idx)
        out = []
        for i, (plan, st) in enumerate(zip(plans, states)):
            if plan[1]:  # a client with no personalisation step keeps its state
                aux[i].update({f"personal_{k}": v for k, v in means[i].items()})
                st = method.after_personal(personal[i], payload, st, reports[i])
            out.append(st)
        return out

    if has_personal and method.personal_first:
        states = personal_stage(starts, states)
        starts = [method.local_start(payload, st) for st in states]
    plan = plan_stage(method, settings, "upload", clients, states, [p[0] for p in plans], [lr] * len(clients),
                      payload, round_idx, pairs)
    trained, means = runner.run_stage(plan, starts, states, clients, payload, round_idx)
    results = []
    for i, k in enumerate(clients):
        upload, new_state = method.after_training(trained[i], payload, states[i], reports[i])
        stage_means = dict(means[i])
        results.append(ClientResult(k, upload, new_state, reports[i], stage_means.pop("loss", 0.0), acc_before[i],
                                    None, stage_means))
    if has_personal and not method.personal_first:
        for r, st in zip(results, personal_stage(trained, [r.client_state for r in results])):
            r.client_state = st
    for r, a in zip(results, aux):
        r.aux.update(a)
    personal = [method.personal_state(t, r.client_state) for t, r in zip(trained, results)]
    for r, acc in zip(results, runner.accuracies(personal, clients, (round_idx, 3))):
        r.acc_after = acc
    if getattr(runner, "score_validation", False):
        for r, acc in zip(results, runner.val_accuracies(personal, clients, (round_idx, 4))):
            r.val_after = acc
    return results


def dispatch(method: Method, info: FederationInfo, round_idx: int, clients: list[int], global_state: State,
             server_state: State, client_states: dict[int, State], device: torch.device
             ) -> tuple[State, dict[int, State], dict[int, State]]:
    """What the server sends a round's ``clients``: the payload (``broadcast``), each client's
    state on ``device`` with its own ``download`` merged in (a client never seen before starts
    from ``client_init``, kept in ``client_states``), and the downloads (counted as sent)."""
    for k in clients:
        if k not in client_states:
            client_states[k] = method.client_init(k, global_state, info)
    payload = method.broadcast(global_state, server_state)
    downloads = {k: method.download(server_state, k, round_idx) for k in clients}
    on_device = {k: {**to_device(client_states[k], device), **to_device(downloads[k], device)} for k in clients}
    return payload, on_device, downloads


class Executor(Protocol):
    """What the runner asks of the executor that trains a round's clients (sequential, vectorised,
    a pack's lane, torchrun's, Flower's); an executor subclasses this for the defaults below."""

    name: str = "executor"
    remote_states: bool = False  # client states live elsewhere (Flower's nodes): downloads passed apart
    failed: tuple | list = ()  # clients of the last round that did not answer (Flower), left out
    peak_state_bytes: int = 0  # the largest stacked training state (bytes), recorded per round
    round_peak_bytes: int | None = None  # the device allocator's peak in the last round (CUDA)
    validates: bool = False  # can score personal models on a validation hold-out (val_accuracies)
    score_validation: bool = False  # set by the runner for the final personalisation pass

    @property
    def sequential(self):
        """The executor that retries a failed round client by client (``train_client``); None: none."""
        return None

    def train_round(self, round_idx: int, clients: list[int], payload: State, client_states: dict, lr: float,
                    **kw) -> list[ClientResult]:
        """Train ``clients`` from ``payload`` and their states; their results in the order given."""
        ...


def to_device(state: State, device: torch.device) -> State:
    return {k: v.to(device) for k, v in state.items()}


__all__ = ["ClientResult", "Executor", "LocalSettings", "StagePlan", "StageRunner", "batch_schedule", "client_round",
           "dispatch", "local_budget", "make_forward", "plan_stage", "stage_loss", "stage_schedules", "to_device"]
