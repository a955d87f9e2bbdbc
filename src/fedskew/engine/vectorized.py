"""The vectorised executor: all selected clients of a round train as one ``torch.func`` program.

Parameters, buffers (BatchNorm statistics included), momentum buffers and per-client method state of the selected
clients are stacked on a leading client dimension. Each local step is the vmapped loss of the clients and one
``torch.autograd.grad`` of its sum (client k's loss depends only on row k), followed by torch.optim.SGD's fused kernel
on the stacked tensors, with its exact semantics (weight decay added to the gradient, then ``buf = m * buf + g``, ``p -=
lr * buf``; clipping of each client's global grad norm as ``clip_grad_norm_`` does it), or torch.optim.Adam / AdamW's
arithmetic with each client's own step count (``optimizer=adam|adamw``; batched_sgd.py). Stacked linear weights live in
the memory layout of their vmapped gradients, where the fused kernel runs on contiguous memory.

Unequal clients. Every client keeps exactly the batch schedule of the sequential executor (one
permutation per epoch, last batch of an epoch smaller); clients that have finished take no part in
later steps (masking by omission). Two ways to train the clients of a step whose batch sizes differ:

* padded (one call per step): shorter batches are padded to the longest with copies of their last
  sample at weight 0 (``Forward.weights``; real rows 1/b). Exact only when the loss is a batch mean
  of per-sample terms computed with ``fwd.mean`` / ``fwd.cross_entropy`` and the model has no
  BatchNorm (padding would move its batch statistics), so it is used only where the method
  declares it (``Method.padding_exact``) and the model has no BatchNorm, unless ``pad_batches=false``.
  The first padded step of each loss is checked against the same client without its padding.
* grouped (exact for every method): one call per distinct batch size among the clients still
  training; with equal sizes that is one group per step and no gather at all.

Mixed precision (``precision=bf16|fp16``): the training forward runs on low-precision copies of the
weights (:func:`~fedskew.models.functional.low_precision`, the same cast as the sequential executor's);
fp16 keeps one dynamic loss scale per client with torch.amp.GradScaler's rules.

Chunks and memory. ``max_parallel_clients`` caps how many clients are stacked at once; by default
the chunk is all selected clients unless 4 copies of their parameters would exceed a quarter of the
device's budget (:class:`DeviceMemory`) or, on CPU, a step's activations would exceed
``CPU_STEP_BYTES`` (large stacked tensors fall out of the caches: a BatchNorm CNN with 1,000
clients ran 2.4x slower stacked whole than in chunks of 20). On CUDA the allocator's peak of each chunk is measured
(``round_peak_bytes``, recorded as ``memory/peak_device_bytes``) and later chunks are sized by the
measured bytes per client; a chunk that runs out of memory is retried at half the size.
``peak_state_bytes`` reports the stacked training state of the largest chunk. Nothing in the step
loop reads a device value back to the host (per-step control is host-side numpy).

Fallback. A method that sets ``vectorizable = False``, or whose loss fails under ``vmap`` (an
unsupported op, data-dependent control flow), runs on the sequential executor instead, after a
one-line notice; results are never silently different.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import vmap

from fedskew.algorithms.base import ClientReport, Method, State
from fedskew.algorithms.compose import lane_options
from fedskew.algorithms.tensors import sam_perturbation
from fedskew.data.augment import crop_flip
from fedskew.data.federated import Federation
from fedskew.engine.batched_sgd import FP16_INIT_SCALE, optimizer_state, optimizer_step_, unscale
from fedskew.engine.local import SequentialExecutor, join_pairs
from fedskew.engine.memory import GATHER_BYTES, DeviceMemory, chunk_size
from fedskew.engine.protocol import (
    ClientResult,
    Executor,
    LocalSettings,
    Stage,
    StagePlan,
    client_round,
    make_forward,
    stage_loss,
)
from fedskew.models.functional import call, in_eval_mode, low_precision
from fedskew.models.nets import DROPOUT_MASKS, BufferMasks, StreamDropout, dropout_mask
from fedskew.streams import dropout_generator


def stack_states(states: list[State]) -> State:
    keys = set(states[0])
    for s in states[1:]:
        if set(s) != keys:
            raise ValueError(f"client states differ in their keys ({sorted(keys)} vs {sorted(s)}); "
                             f"a vectorised method must give every client state the same tensors.")
    return {k: torch.stack([s[k] for s in states]) for k in states[0]}


def unstack(state: State, i: int) -> State:
    return {k: v[i] for k, v in state.items()}


def means_per_client(sums: dict[str, torch.Tensor], steps: np.ndarray) -> dict[str, list[float]]:
    """Each tracked value's mean over every client's steps, moved to the host in one transfer."""
    if not sums:
        return {}
    div = torch.from_numpy(np.maximum(steps, 1)).to(next(iter(sums.values())))
    table = (torch.stack(list(sums.values())) / div).tolist()
    return dict(zip(sums, table))


# batch size from which a convolutional model trains one client after another on the CPU (measured
# on 2 cores, 10 clients: SimpleCNN on Fashion-MNIST 0.96-1.01 x at B = 16, 0.75-0.85 x at B = 64;
# benchmarks/engine_speed.py --dataset fmnist --models simplecnn --batch 64)
CPU_CONV_BATCH = 32


def step_groups(col: np.ndarray, padded: bool, contiguous: bool) -> list[np.ndarray]:
    """The lanes that take a step together, given each lane's batch size ``col`` at this step (0:
    finished): all at once when ``padded``, else one group per batch size (split into contiguous
    runs when ``contiguous``: views instead of gathered copies, for large states)."""
    if padded:
        return [np.flatnonzero(col)] if col.any() else []
    groups = [np.flatnonzero(col == size) for size in np.unique(col) if size]
    if contiguous:
        groups = [run for g in groups for run in np.split(g, np.flatnonzero(np.diff(g) != 1) + 1)]
    return groups


def cpu_convolutions_alone(model: nn.Module, device: torch.device, batch_size: int) -> bool:
    """Whether a run trains faster one client after another: on the CPU, a convolutional model
    with batches of at least ``CPU_CONV_BATCH`` (a vmapped convolution there is one grouped
    convolution over the stacked clients, slower than the clients' own; a rule of the
    configuration, so a run's results never depend on a timing)."""
    return (device.type == "cpu" and batch_size >= CPU_CONV_BATCH
            and any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules()))


def eval_groups(lengths: np.ndarray, slack: float = 1.25) -> list[np.ndarray]:
    """Clients scored together in one vmapped pass, given each one's number of test samples: sorted
    longest first, a group grows while its rows padded to its longest stay within ``slack`` times
    its real rows (clients with no samples are left out). Each group's members in ascending order."""
    order = np.argsort(-lengths, kind="stable")
    groups, start, real = [], 0, 0
    for i, k in enumerate(order):
        n = int(lengths[k])
        if n == 0:
            break
        if i > start and (i - start + 1) * int(lengths[order[start]]) > slack * (real + n):
            groups.append(np.sort(order[start:i]))
            start, real = i, 0
        real += n
    else:
        i = len(order)
    if i > start:
        groups.append(np.sort(order[start:i]))
    return groups


def put(target: dict, values: dict, a: int, b: int, gi: torch.Tensor | None, add: bool = False) -> None:
    """Write (``add``: add) a group's stacked ``values`` into the full stacks of ``target``: rows
    a:b (a contiguous group, ``gi`` None) or rows ``gi``."""
    for k, v in values.items():
        if gi is None:
            if add:
                target[k][a:b] += v
            else:
                target[k][a:b] = v
        elif add:
            target[k].index_add_(0, gi, v)
        else:
            target[k].index_copy_(0, gi, v)


def compiled(losses, device: torch.device):
    """``losses`` (a vmapped loss) through ``torch.compile``: its forward and, by AOTAutograd, its
    backward as compiled graphs (the step's ``torch.autograd.grad`` runs the compiled backward), on
    CUDA replayed as CUDA graphs (``mode="reduce-overhead"``) to cut the host-bound step's kernel
    launches. The optimiser's update stays eager (``optimizer_step_``).

    Every step shape compiles once: vmap reads its number of lanes in Python, so the lanes a step
    takes (clients run out of batches at different steps) and a padded batch's rows specialise the
    graph, and every vmapped loss shares vmap's one code object, whose recompile limit (8 by
    default) would send the rest back to eager; ``COMPILE_SHAPES`` raises it."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILE_SHAPES)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           4 * COMPILE_SHAPES)
    return torch.compile(losses, mode="reduce-overhead" if device.type == "cuda" else None)


COMPILE_SHAPES = 256  # step shapes a run's stacked loss may compile (lanes x padded rows x stage)


@torch.no_grad()
def apply_correction(params: State, correction: State, lr) -> None:
    """``p -= lr * correction`` (``Method.step_correction``) for the parameters it names; ``lr`` a
    float or one value per lane."""
    keys = [k for k in params if k in correction]
    if isinstance(lr, torch.Tensor):
        for k in keys:
            params[k].sub_(correction[k] * lr.view(-1, *[1] * (correction[k].dim() - 1)))
    else:
        torch._foreach_add_([params[k] for k in keys], [correction[k] for k in keys], alpha=-lr)


class VectorizedExecutor(Executor):
    name = "vectorized"
    validates = True
    sequential = None  # (set per instance: the sequential executor of its fallback and retries)

    def __init__(self, model: nn.Module, fed: Federation, method: Method, settings: LocalSettings,
                 device: torch.device, max_parallel_clients: int | None = None, pad_batches: bool = True):
        self.model = model
        self.fed = fed
        self.method = method
        self.settings = settings
        self.device = device
        self.max_parallel_clients = max_parallel_clients
        self.sequential = SequentialExecutor(model, fed, method, settings, device)
        self.x, self.y = self.sequential.x, self.sequential.y
        self.train_idx, self.test_idx = self.sequential.train_idx, self.sequential.test_idx
        self.fallback_reason: str | None = None if method.vectorizable else \
            f"method {method.name} is marked not vectorizable"
        if self.fallback_reason is None and self.cpu_convolutions_alone(model, device, settings):
            self.fallback_reason = (f"on the CPU, convolutions of batches of {settings.batch_size} train faster one "
                                    f"client after another (stacked: 0.75-0.85 x, SimpleCNN on Fashion-MNIST, B = 64, "
                                    f"measured)")
        if self.fallback_reason:
            print(f"fedskew: vectorized executor falls back to sequential: {self.fallback_reason}.", flush=True)
        self._checked = False
        self.peak_state_bytes = 0
        self.memory = DeviceMemory(device)
        self.round_peak_bytes: int | None = None  # the allocator's peak in the last round (CUDA)
        self._client_bytes = 0  # measured device bytes per client of a chunk (CUDA), sizes later chunks
        self._step_bytes: list = []  # activations of one client's step (CPU chunking), once measured
        self._last_trained: tuple[State, list[State]] | None = None  # the last stage's stack and its views
        self._int_buffers = {k: v for k, v in model.named_buffers() if not v.is_floating_point()}
        self._dtype = next(model.parameters()).dtype
        # Stacked linear weights are kept in the memory layout of their vmapped gradients ([G, in,
        # out] in memory, seen as [G, out, in]): otherwise every SGD step pays a transposing copy
        # (measured: 100 ms a step for 1,000 clients of a 784-64 layer, more than the step itself).
        self._transposed = {f"{name}.weight" if name else "weight" for name, m in model.named_modules()
                            if isinstance(m, nn.Linear)}
        self._has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        self._cast = low_precision(model, settings.precision)
        self._vmapped_losses: dict = {}  # (stage, payload per lane, padded, lane options) -> vmapped loss
        self._eval = vmap(self._logits, in_dims=(0, 0))
        # Padding (one call per step): only where it is exact (module docstring).
        self.padded = {stage: pad_batches and not self._has_bn and method.padding_exact(stage)
                       for stage in ("upload", "personal")}
        self._verified: set = set()  # stages whose padding has been checked against no padding
        # dropout layers, trained on masks drawn ahead from each client's stream (StreamDropout)
        # (StreamUniform too)
        self._dropouts = [m for m in model.modules() if isinstance(m, StreamDropout) and m.p != 0]
        self._dropout_shapes: list | None = None
        self._mask_blocks: list[int] = []

    def cpu_convolutions_alone(self, model: nn.Module, device: torch.device, settings: LocalSettings) -> bool:
        """:func:`cpu_convolutions_alone`; a pack's lanes always stack."""
        return not getattr(self, "pack", None) and cpu_convolutions_alone(model, device, settings.batch_size)

    # -- pure pieces -------------------------------------------------------------------------------
    def _loss(self, stage: Stage):
        """One client's (loss, aux) of the stage's loss (``local_loss`` or ``personal_loss``), to vmap;
        ``options``: the lane's values of method options that differ between the runs of a pack
        (:func:`~fedskew.algorithms.compose.lane_options`), else None; ``masks``: the lane's dropout
        masks drawn ahead for this step (:class:`~fedskew.models.nets.BufferMasks`), else None."""
        def loss(params, buffers, x, y, payload, client_state, weights=None, options=None, masks=None):
            fwd = make_forward(self.model, params, buffers, self._cast, weights)
            loss_fn = stage_loss(self.method, stage)
            token = None if masks is None else DROPOUT_MASKS.set(BufferMasks(masks, self._mask_blocks))
            try:
                if options is None:
                    return loss_fn(fwd, params, x, y, payload, client_state)
                with lane_options(self.method, options):
                    return loss_fn(fwd, params, x, y, payload, client_state)
            finally:
                if token is not None:
                    DROPOUT_MASKS.reset(token)
        return loss

    def losses(self, stage: Stage, lane_payload: bool = False, padded: bool = False, options: bool = False,
               masks: bool = False):
        """The stage's loss vmapped over a stack of clients (or lanes): the payload shared by all
        (``lane_payload`` False) or one per lane, padding weights, lane options and dropout masks
        when asked."""
        key = (stage, lane_payload, padded, options, masks)
        if key not in self._vmapped_losses:
            f = vmap(self._loss(stage), in_dims=(
                0, 0, 0, 0, 0 if lane_payload else None, 0, 0 if padded else None, 0 if options else None,
                0 if masks else None))
            self._vmapped_losses[key] = compiled(f, self.device) if self.settings.compile else f
        return self._vmapped_losses[key]

    def _dropout_masks(self, gens: list, members: np.ndarray, rows: np.ndarray, longest: int, passes: int
                       ) -> list[torch.Tensor]:
        """Each member lane's dropout masks for one step, drawn ahead from its generator in the
        order the sequential executor draws them (per forward pass, each StreamDropout layer in
        forward order, ``rows[j]`` rows of lane j), one [lanes, N] table per pass; every layer's
        block is ``longest`` rows long, a lane's own rows first, the rest ones (padding)."""
        if self._dropout_shapes is None:  # the input shape of each StreamDropout, probed once
            shapes = []
            hooks = [m.register_forward_pre_hook(lambda mod, inp: shapes.append((mod.p, tuple(inp[0].shape[1:]))))
                     for m in self._dropouts]
            try:
                with torch.no_grad():
                    in_eval_mode(self.model, lambda: self.model(self.x[:1]))
            finally:
                for h in hooks:
                    h.remove()
            self._dropout_shapes = shapes
        sizes = [longest * math.prod(f) for _, f in self._dropout_shapes]
        self._mask_blocks = np.cumsum([0] + sizes[:-1]).tolist()
        tables = []
        for _ in range(passes):
            table = torch.ones(len(members), sum(sizes))
            for j, lane in enumerate(members):
                for (p, feat), at in zip(self._dropout_shapes, self._mask_blocks):
                    m = dropout_mask(p, (int(rows[j]), *feat), gens[lane]).flatten()
                    table[j, at:at + len(m)] = m
            tables.append(table.to(self.device))
        return tables

    def _logits(self, state, x):
        return call(self.model, state, x, features=False)

    # -- helpers -----------------------------------------------------------------------------------
    def chunk_size(self, num_clients: int) -> int:
        """Clients stacked at once (:func:`fedskew.engine.memory.chunk_size`)."""
        return chunk_size(num_clients, self.model, self.device, self.memory, self.x[:1], self.settings.batch_size,
                          self.max_parallel_clients, self._client_bytes, self._step_bytes)

    @torch.no_grad()
    def local_accuracies(self, states: State, clients: list[int]) -> list[float | None]:
        """Each client's state (row i of the stack: ``clients[i]``) on its own local test split, in
        eval mode. One model for all (a broadcast: every stacked tensor expanded, or one client):
        one plain pass over their test samples together. Otherwise clients of similar test size
        (:func:`eval_groups`) are scored in one vmapped pass each, their test sets padded to the
        group's longest and masked (eval mode, so padding cannot leak into the real rows)."""
        lengths = np.array([len(self.test_idx[k]) for k in clients])
        if lengths.max(initial=0) == 0:
            return [None] * len(clients)
        hits = torch.zeros(len(clients), dtype=torch.long, device=self.device)
        was_training = self.model.training
        self.model.eval()
        try:
            shared = len(clients) == 1 or all(v.stride(0) == 0 for v in states.values())
            if shared:
                rows = torch.cat([self.test_idx[k] for k in clients])
                owner = self._to_device(np.repeat(np.arange(len(clients)), lengths))
                right = self._logits({k: v[0] for k, v in states.items()}, self.x[rows]).argmax(-1) == self.y[rows]
                hits.index_add_(0, owner, right.long())
            for members in [] if shared else eval_groups(lengths):
                hits[self._to_device(members)] = self._group_hits(states, clients, members, lengths[members])
        finally:
            self.model.train(was_training)
        correct = hits.tolist()  # one transfer
        return [correct[i] / n if n else None for i, n in enumerate(lengths)]

    def _group_hits(self, states: State, clients: list[int], members: np.ndarray, lengths: np.ndarray
                    ) -> torch.Tensor:
        """Correct predictions of the stack rows ``members`` (ascending) on their clients' test
        splits of ``lengths`` samples, one vmapped pass: a contiguous range of the stack as views,
        else gathered copies; a tensor shared by all (expanded) stays expanded."""
        a, b = int(members[0]), int(members[-1]) + 1
        if b - a == len(members):
            group = {k: v[a:b] for k, v in states.items()}
        else:
            at = self._to_device(members)
            group = {k: v[:1].expand(len(members), *v.shape[1:]) if v.stride(0) == 0 else v.index_select(0, at)
                     for k, v in states.items()}
        longest = int(lengths.max())
        # flat positions of each client's samples in the [members, longest] table (host-side)
        at = np.repeat(np.arange(len(members)) * longest - (np.cumsum(lengths) - lengths), lengths) + \
            np.arange(lengths.sum())
        rows = torch.zeros(len(members) * longest, dtype=torch.long, device=self.device)
        rows[self._to_device(at)] = torch.cat([self.test_idx[clients[i]] for i in members])
        rows = rows.view(len(members), longest)
        mask = torch.arange(longest, device=self.device) < self._to_device(lengths)[:, None]
        return ((self._eval(group, self.x[rows]).argmax(-1) == self.y[rows]) & mask).sum(1)

    # -- the round ---------------------------------------------------------------------------------
    def train_round(self, round_idx: int, clients: list[int], payload: State,
                    client_states: dict[int, State], lr: float) -> list[ClientResult]:
        if self.fallback_reason:
            return self.sequential.train_round(round_idx, clients, payload, client_states, lr)
        if not self._checked:
            try:
                out = self._train_all(round_idx, clients, payload, client_states, lr)
            except (RuntimeError, ValueError, NotImplementedError) as exc:
                # If the sequential executor fails the same way, the error is not vmap's (a failing
                # client, bad data): it propagates and the executor stays vectorised.
                out = self.sequential.train_round(round_idx, clients, payload, client_states, lr)
                self.fallback_reason = str(exc).splitlines()[0][:200]
                print(f"fedskew: vectorized executor falls back to sequential for method {self.method.name}: "
                      f"{self.fallback_reason}", flush=True)
                return out
            self._checked = True
            return out
        return self._train_all(round_idx, clients, payload, client_states, lr)

    def _train_all(self, round_idx, clients, payload, client_states, lr) -> list[ClientResult]:
        """All clients, chunk after chunk. A chunk that runs out of device memory is retried at half
        the size (chunks are independent, so results do not change); the size then stays halved."""
        size = self.chunk_size(len(clients))
        results, i = [], 0
        self.round_peak_bytes = None
        while i < len(clients):
            chunk = clients[i:i + size]
            start_bytes = self.memory.allocated()
            self.memory.reset_peak()
            try:
                results += self._train_chunk(round_idx, chunk, payload, client_states, lr)
            except torch.OutOfMemoryError:
                if size == 1:
                    raise
                size = max(1, size // 2)
                self.max_parallel_clients = size
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                print(f"fedskew: out of device memory with {len(chunk)} clients stacked; "
                      f"continuing with chunks of {size} (max_parallel_clients={size}).", flush=True)
                continue
            peak = self.memory.peak()
            if peak is not None:
                self.round_peak_bytes = max(self.round_peak_bytes or 0, peak)
                self._client_bytes = max(self._client_bytes, -(-(peak - start_bytes) // len(chunk)))
            i += len(chunk)
        return results

    def _stack_starts(self, starts: list[State]) -> State:
        """Stack the clients' start states; a tensor shared by all clients (FedAvg's broadcast
        model) is expanded instead of copied G times."""
        out = {}
        for k, first in starts[0].items():
            if all(s[k] is first for s in starts):
                out[k] = first.unsqueeze(0).expand(len(starts), *first.shape)
            else:
                out[k] = torch.stack([s[k] for s in starts])
        return out

    def _train_chunk(self, round_idx, clients, payload, client_states, lr) -> list[ClientResult]:
        # Clients sorted by local size: those that share a batch size at a step are then mostly a
        # contiguous range of the stack, trained through views with no gather or scatter.
        given_order = {k: i for i, k in enumerate(clients)}
        clients = sorted(clients, key=lambda k: len(self.train_idx[k]))
        results = client_round(self, round_idx, clients, payload, [client_states[k] for k in clients], lr)
        self._last_trained = None
        return sorted(results, key=lambda r: given_order[r.client_id])

    # -- StageRunner (fedskew.engine.protocol) -------------------------------------------------------
    def num_samples(self, client_id: int) -> int:
        return self.sequential.num_samples(client_id)

    def prepare(self, round_idx: int, client_id: int, payload: State, client_state: State, lr: float = 0.0) -> State:
        return self.sequential.prepare(round_idx, client_id, payload, client_state, lr)

    def report(self, client_id: int, num_steps: int, lr: float) -> ClientReport:
        return self.sequential.report(client_id, num_steps, lr)

    def accuracies(self, states: list[State], clients: list[int], rng=None) -> list[float | None]:
        """All states in one vmapped pass (:meth:`local_accuracies`); the views of the last trained
        stack (FedAvg's personal model is the trained one) are scored on the stack itself. (``rng``
        is not needed: a model that draws random numbers never runs vectorised.)"""
        last = self._last_trained
        if last is not None and len(last[1]) == len(states) and all(a is b for a, b in zip(states, last[1])):
            return self.local_accuracies(last[0], clients)
        return self.local_accuracies(self._stack_starts(states), clients)

    def val_accuracies(self, states: list[State], clients: list[int], rng=None) -> list[float | None]:
        """One client after another (:meth:`SequentialExecutor.val_accuracies`): scored once a run,
        in its final personalisation pass."""
        return self.sequential.val_accuracies(states, clients, rng)

    @property
    def score_validation(self) -> bool:
        return self.sequential.score_validation

    @score_validation.setter
    def score_validation(self, on: bool) -> None:  # the fallback path scores through the sequential one
        self.sequential.score_validation = on

    def run_stage(self, plan: StagePlan, starts, states, clients, payload, round_idx):
        request = self.stage_request(plan, starts, states, clients, payload, round_idx)
        return self.finish_request(request, *self.train_requests([request])[0])

    def stage_request(self, plan: StagePlan, starts, states, clients, payload, round_idx) -> StageRequest:
        """Everything one stage of this run's clients needs, stacked (its lanes)."""
        if len(set(plan.lrs)) > 1:
            raise ValueError(f"clients of one round differ in their {plan.stage} learning rate")
        gens = [dropout_generator(self.settings.seed, round_idx, k, plan.stream) for k in clients] \
            if self._dropouts else None
        return StageRequest(self, plan.stage, self._stack_starts(starts), stack_states(states), plan.schedules,
                            [self.train_idx[k] for k in clients], payload, plan.lrs[0], plan.trainable,
                            torch.cat(plan.augment) if plan.augment else None,
                            stack_states(plan.corrections) if plan.corrections else None,
                            self.padded[plan.stage] and plan.paddable, plan.sam, plan.pairs, gens)

    def finish_request(self, request: StageRequest, trained_all: State, sums: dict, steps: np.ndarray):
        """The stage's result as ``StageRunner.run_stage`` gives it: each client's trained state (views
        of the stack) and mean tracked values."""
        trained = [unstack(trained_all, i) for i in range(len(request.rows))]  # views; methods never write in place
        self._last_trained = (trained_all, trained)
        table = means_per_client(sums, steps)
        return trained, [{k: v[i] for k, v in table.items()} for i in range(len(request.rows))]

    def train_requests(self, requests: list[StageRequest], check: bool = False) -> list[tuple[State, dict, np.ndarray]]:
        """Train stage requests as one stacked program: (stacked trained state, tracked sums, steps)
        per request. This executor trains its own run's request; a run of a pack
        (:class:`~fedskew.engine.lanes.LaneExecutor`) trains several runs' side by side."""
        (r,) = requests
        return [self._run_stage(r.stage, r.start, r.cstates, r.schedules, r.rows, r.executor.x, r.executor.y,
                                r.payload, False, r.lr, r.trainable, r.augs, r.correction, r.padded, r.sam, r.pairs,
                                gens=r.gens)]

    def _run_stage(self, stage: Stage, start: State, cstates: State, schedules: list[list[np.ndarray]],
                   lane_rows: list[torch.Tensor], x_table: torch.Tensor, y_table: torch.Tensor, payload: State,
                   lane_payload: bool, lr, trainable: frozenset[str] | None = None, augs: torch.Tensor | None = None,
                   correction: State | None = None, padded: bool = False, sam=None, pairs: list | None = None,
                   options: dict | None = None, check=None, gens: list | None = None):
        """Local SGD of every lane (a client of this run, or of a run of a pack) from the stacked
        ``start`` on its own batch schedule over its training rows ``lane_rows`` of ``x_table``,
        ``y_table``, updating the ``trainable`` parameters (None: all), batches augmented with their
        rows of ``augs`` (the lanes' crop/flip draws in lane order; None: off), ``p -= lr *
        correction`` after every step (stacked ``Method.step_correction``); ``padded``: the lanes of a
        step form one call, shorter batches padded with zero-weight rows; ``sam`` (``Method.sam``):
        each step's gradient taken again at w + eps, every lane on its own eps; ``pairs``
        (``Method.paired_samples``, every lane's or none): each batch joined by its rows of them
        (never padded). ``payload``: shared by every lane, or (``lane_payload``) one per lane; ``lr``
        a float or one per lane; ``options`` the lanes' method option values (None: the method's
        own); ``check`` (a pack's :class:`~fedskew.engine.lanes.LaneCheck`): given every step group's
        losses and tracked values until it is done (its check that each run's lanes compute what the
        run computes alone); ``gens``: each lane's dropout generator (None: the model has no dropout).
        Returns the stacked trained state
        (parameters and float buffers), the summed tracked values per lane and each lane's number of
        steps. Nothing inside the step loop reads a device value back to the host."""
        s = self.settings
        G = len(lane_rows)
        param_names = [n for n, _ in self.model.named_parameters()]
        params = {n: self._stacked_copy(n, start[n]) for n in param_names}
        buffers = {n: v.clone() for n, v in start.items() if n not in params}
        buffers.update({n: v.unsqueeze(0).repeat(G, *[1] * v.dim()) for n, v in self._int_buffers.items()})
        updated = [n for n in param_names if trainable is None or n in trainable]
        opt_state = optimizer_state({n: params[n] for n in updated}, s)  # (SGD's momentum or Adam's moments)
        state_bytes = sum(t.numel() * t.element_size() for t in [*params.values(), *buffers.values()]) * 4
        self.peak_state_bytes = max(self.peak_state_bytes, state_bytes)
        lane_lr = isinstance(lr, torch.Tensor)

        steps, sizes, first, rows, paired = self._flat_schedules(lane_rows, schedules, pairs)
        sizes_d, first_d = self._to_device(sizes), self._to_device(first)
        positions = torch.arange(int(sizes.max()), device=self.device)
        plain_losses = self.losses(stage, lane_payload, False, options is not None, gens is not None)
        padded_losses = self.losses(stage, lane_payload, True, options is not None, gens is not None)
        slots = 1 + (pairs[0][1].shape[1] if pairs is not None else 0)  # rows of a batch per own sample

        sums: dict[str, torch.Tensor] = {}
        if s.precision == "fp16":  # one dynamic loss scale per lane, as torch.amp.GradScaler keeps it
            scaler = {"scale": torch.full((G,), FP16_INIT_SCALE, device=self.device),
                      "good": torch.zeros(G, dtype=torch.long, device=self.device)}
        self.model.train()
        for step in range(sizes.shape[1]):
            col = sizes[:, step]
            for members in step_groups(col, padded, state_bytes > GATHER_BYTES):
                a, b = int(members[0]), int(members[-1]) + 1
                if b - a == len(members):  # contiguous: views, updated in place
                    gi = None
                    def take(v, a=a, b=b):
                        return v[a:b]
                else:  # scattered: gathered copies, written back after the step
                    gi = self._to_device(members)
                    def take(v, gi=gi):
                        return v.index_select(0, gi)
                def pick(d):
                    return {k: take(v) for k, v in d.items()}
                n, longest = take(sizes_d[:, step]), int(col[members].max())
                # row j of a lane's batch: its sample j, or (padding) its last sample again
                at = take(first_d[:, step])[:, None] + torch.minimum(positions[:longest], n[:, None] - 1)
                x, y = self._batch(at, rows, x_table, y_table, augs, paired)
                p, buf, mom = pick(params), pick(buffers), pick(opt_state)
                leaves = {k: v.detach().requires_grad_(k in updated) for k, v in p.items()}
                c = pick(cstates)
                pay = pick(payload) if lane_payload else payload
                opts = None if options is None else {h: pick(v) for h, v in options.items()}
                masks = [None, None, None] if gens is None else self._dropout_masks(
                    gens, members, col[members] * slots, longest * slots,
                    1 if sam is None else 3 if getattr(sam, "ascent", None) is not None else 2)
                ragged = int(col[members].min()) < longest
                if ragged:  # padded rows weigh 0
                    weights = (positions[:longest] < n[:, None]) / n[:, None].to(self._dtype)
                    def losses_at(w, mk=masks[0], b=buf, x=x, y=y, c=c, pay=pay, opts=opts, weights=weights):
                        return padded_losses(w, b, x, y, pay, c, weights, opts, mk)
                    losses, aux = losses_at(leaves)
                    if stage not in self._verified:
                        self._verify_padding(stage, plain_losses, leaves, buf, x, y, pay, lane_payload, c, opts,
                                             masks[0], n, losses, aux)
                else:
                    def losses_at(w, mk=masks[0], b=buf, x=x, y=y, c=c, pay=pay, opts=opts):
                        return plain_losses(w, b, x, y, pay, c, None, opts, mk)
                    losses, aux = losses_at(leaves)
                if check is not None and not check.done:  # a pack's first steps: each run's lanes as alone
                    check(members, col[members] if ragged else [None] * len(members), {"loss": losses, **aux},
                          leaves, buf, x, y, c, masks[0])
                tracked = {"loss": losses, **aux}
                for key, _v in tracked.items():
                    sums.setdefault(key, torch.zeros(G, device=self.device))
                sc = pick(scaler) if s.precision == "fp16" else None
                grads = None if getattr(sam, "ascent", None) is not None else torch.autograd.grad(  # (FedSOL: unread)
                    (losses if sc is None else losses * sc["scale"]).sum(), [leaves[k] for k in updated],
                    allow_unused=True, materialize_grads=True)
                # Each lane's loss depends only on its own row of the stack, so the gradient of
                # the sum is every lane's own gradient.
                if sam is not None:  # SAM / ASAM / FedSOL: the gradient at w + eps, each lane its own eps
                    ascent = None if getattr(sam, "ascent", None) is None else (
                        self.losses("ascent", lane_payload, ragged, options is not None, gens is not None),
                        (buf, x, y, pay, c, weights if ragged else None, opts))
                    eps, descent_masks = self._sam_eps(sam, leaves, updated, grads, masks, ascent, pay, lane_payload)
                    ascended = {k: (v.detach() + eps[k]).requires_grad_(True) if k in eps else v
                                for k, v in leaves.items()}
                    grads = torch.autograd.grad(losses_at(ascended, descent_masks)[0].sum(),
                                                [ascended[k] for k in updated], allow_unused=True,
                                                materialize_grads=True)
                ok = None
                if sc is not None:
                    grads, ok = unscale(grads, sc)
                    put(scaler, sc, a, b, gi)
                step_lr = take(lr) if lane_lr else lr
                optimizer_step_({k: p[k] for k in updated}, dict(zip(updated, grads)), mom, step_lr, s, ok)
                if correction:
                    apply_correction({k: p[k] for k in updated}, pick(correction), step_lr if lane_lr else lr)
                if gi is not None:  # scattered lanes: their copies written back
                    with torch.no_grad():
                        for d, new in ((params, p), (buffers, buf), (opt_state, mom)):
                            put(d, new, a, b, gi)
                put(sums, {k: v.detach() for k, v in tracked.items()}, a, b, gi, add=True)
        return {**params, **{k: v for k, v in buffers.items() if v.is_floating_point()}}, sums, steps

    @staticmethod
    def _sam_eps(sam, leaves, updated, grads, masks, ascent, payload, lane_payload):
        """A sharpness-aware step's eps of every lane and the dropout masks of its descent pass: from the
        stage loss's ``grads`` (SAM / ASAM), or from the gradient of ``ascent`` (the vmapped
        ``sam.ascent`` and the step's other arguments) by ``sam.perturbation`` (FedSOL)."""
        w = {k: leaves[k].detach() for k in updated}
        if ascent is None:
            return sam_perturbation(w, dict(zip(updated, grads)), sam.rho, sam.adaptive, sam.eta), masks[1]
        loss, args = ascent
        a_grads = torch.autograd.grad(loss(leaves, *args, masks[1])[0].sum(), [leaves[k] for k in updated],
                                      allow_unused=True, materialize_grads=True)
        anchor = payload if lane_payload else {k: v[None] for k, v in payload.items()}
        return sam.perturbation(w, dict(zip(updated, a_grads)), anchor), masks[2]

    def _flat_schedules(self, lane_rows: list, schedules: list[list[np.ndarray]], pairs: list | None):
        """Batch schedules exactly as the sequential executor's, flattened: the samples of lane i at
        step t are ``rows[first[i, t] : first[i, t] + sizes[i, t]]`` (rows of the data table);
        ``sizes`` = 0 once it finished. ``paired``: the paired samples of every lane as one table
        (x, y) and each flattened row's row in it, or None."""
        steps = np.array([len(sc) for sc in schedules])
        sizes = np.zeros((len(lane_rows), max(int(steps.max()), 1)), dtype=np.int64)
        first = np.zeros_like(sizes)
        rows, local, base = [], [], 0
        if pairs is not None and (any(p is None for p in pairs) or len({p[1].shape[1] for p in pairs}) > 1):
            raise ValueError(f"method {self.method.name} gives paired samples to some clients of a round and not to "
                             f"others, or different numbers of them: the vectorised executor needs every client's")
        offsets = np.cumsum([0] + [len(p[1]) for p in pairs[:-1]]) if pairs is not None else None
        for i, (idx, sched) in enumerate(zip(lane_rows, schedules)):
            lengths = np.array([len(b) for b in sched], dtype=np.int64)
            sizes[i, :len(sched)] = lengths
            first[i, :len(sched)] = base + np.cumsum(lengths) - lengths
            picked = np.concatenate(sched) if sched else np.zeros(0, dtype=np.int64)
            rows.append(idx[self._to_device(picked)])
            if pairs is not None:
                local.append(picked + offsets[i])
            base += len(picked)
        paired = None
        if pairs is not None:
            paired = (torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs]),
                      self._to_device(np.concatenate(local)))
        return steps, sizes, first, torch.cat(rows), paired

    def _batch(self, at: torch.Tensor, rows: torch.Tensor, x_table, y_table, augs, paired):
        """The step's batches of a group of lanes (``at``: [lanes, batch] positions in ``rows``),
        augmented and joined by their paired samples."""
        pad = self.settings.augment_pad
        x = x_table[rows[at]]
        if augs is not None:
            x = crop_flip(x, augs[at], pad)
        y = y_table[rows[at]]
        if paired is not None:
            pair_x, pair_y, local = paired
            x, y = join_pairs(x, y, pair_x[local[at]], pair_y[local[at]], augs[at] if augs is not None else None, pad)
        return x, y

    def _stacked_copy(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A copy of a stacked parameter to train in place (linear weights in their gradients' layout)."""
        if name in self._transposed and value.dim() == 3:
            return value.transpose(1, 2).contiguous().transpose(1, 2)
        return value.clone(memory_format=torch.contiguous_format)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host index array on the device (pinned and asynchronous on CUDA: no stall)."""
        t = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _verify_padding(self, stage, plain_losses, leaves, buf, x, y, payload, lane_payload, c, opts, masks, n,
                        losses, aux) -> None:
        """Once per stage: the padded lane with the shortest batch recomputed without its padding
        rows must give the same loss and tracked values. A method that declares
        ``per_sample_loss`` but averages with ``.mean()`` (padding rows counted) fails here."""
        i = int(n.argmin())
        m = int(n[i])
        def one(d):
            return None if d is None else {k: one(v) if isinstance(v, dict) else v[i:i + 1] for k, v in d.items()}
        with torch.no_grad():
            ref_loss, ref_aux = plain_losses(one(leaves), {k: v.clone() for k, v in one(buf).items()},
                                             x[i:i + 1, :m], y[i:i + 1, :m], one(payload) if lane_payload else payload,
                                             one(c), None, one(opts), None if masks is None else masks[i:i + 1])
        got = {"loss": losses[i:i + 1], **{k: v[i:i + 1] for k, v in aux.items()}}
        for key, ref in {"loss": ref_loss, **ref_aux}.items():
            if not torch.allclose(got[key].detach(), ref, rtol=1e-4, atol=1e-6):
                # this stage is grouped from now on; the round in progress is redone by the caller
                self.padded[stage] = False
                raise ValueError(f"method {self.method.name} declares per_sample_loss, but its '{key}' changes "
                                 f"when zero-weight padding rows join the batch ({ref.item():.6g} -> "
                                 f"{got[key].item():.6g}): average per-sample terms with fwd.mean / "
                                 f"fwd.cross_entropy, or remove the declaration")
        self._verified.add(stage)


@dataclass
class StageRequest:
    """One run's stage as the vectorised executor trains it: its clients are the lanes."""

    executor: VectorizedExecutor
    stage: Stage
    start: State  # stacked start states
    cstates: State  # stacked client states
    schedules: list  # each lane's batches (positions into its rows)
    rows: list  # each lane's training rows of ``executor.x``
    payload: State
    lr: float
    trainable: frozenset | None
    augs: torch.Tensor | None
    correction: State | None
    padded: bool
    sam: object
    pairs: list | None
    gens: list | None = None  # each lane's dropout generator (the model has StreamDropout layers)
