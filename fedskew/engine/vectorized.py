"""The vectorised executor: all selected clients of a round train as one ``torch.func`` program.

Parameters, buffers (BatchNorm statistics included), momentum buffers and per-client method state
of the selected clients are stacked on a leading client dimension. Each local step is one call of
``vmap(grad_and_value(loss))`` over the clients, followed by SGD with momentum and weight decay as
batched ``torch._foreach_*`` ops, with torch.optim.SGD's exact semantics (weight decay added to the
gradient, then ``buf = m * buf + g``, ``p -= lr * buf``; clipping of each client's global grad norm
as ``clip_grad_norm_`` does it).

Unequal clients. Every client keeps exactly the batch schedule of the sequential executor (one
permutation per epoch, last batch of an epoch smaller). At local step s the clients still training
are grouped by their batch size at that step, and each group is one vmapped call; clients that have
finished are simply not in any group (masking by omission). We group rather than pad because a
padded batch changes BatchNorm statistics and every method's batch means; grouping is exact, and
in the common case (equal sizes) there is one group per step and no gather at all.

Chunks. ``max_parallel_clients`` caps how many clients are stacked at once; by default the chunk
is all selected clients unless the stacked training state (parameters, gradients, momentum,
start state: 4 copies per client) would exceed a quarter of the device memory, in which case the
chunk shrinks to fit. ``peak_state_bytes`` reports the stacked state of the largest chunk (and
``peak_device_bytes`` the CUDA allocator's peak when on a GPU).

Fallback. A method that sets ``vectorizable = False``, or whose loss fails under ``vmap`` (an
unsupported op, data-dependent control flow), runs on the sequential executor instead, after a
one-line notice; results are never silently different.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap

from fedskew.data.augment import crop_flip
from fedskew.data.federated import Federation
from fedskew.engine.local import (ClientResult, LocalSettings, SequentialExecutor, bn_recalibration_fn,
                                  frozen_forward, snapshot, stage_schedules)
from fedskew.methods.base import ClientReport, Forward, Method, State
from fedskew.models.functional import feature_fn, in_eval_mode


def stack_states(states: list[State]) -> State:
    keys = set(states[0])
    for s in states[1:]:
        if set(s) != keys:
            raise ValueError(f"client states differ in their keys ({sorted(keys)} vs {sorted(s)}); "
                             f"a vectorised method must give every client state the same tensors.")
    return {k: torch.stack([s[k] for s in states]) for k in states[0]}


def unstack(state: State, i: int) -> State:
    return {k: v[i] for k, v in state.items()}


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


class VectorizedExecutor:
    name = "vectorized"

    def __init__(self, model: nn.Module, fed: Federation, method: Method, settings: LocalSettings,
                 device: torch.device, max_parallel_clients: int | None = None):
        self.model = model
        self.fed = fed
        self.method = method
        self.settings = settings
        self.device = device
        self.max_parallel_clients = max_parallel_clients
        self.sequential = SequentialExecutor(model, fed, method, settings, device)
        self.x, self.y = self.sequential.x, self.sequential.y
        self.train_idx, self.test_idx = self.sequential.train_idx, self.sequential.test_idx
        self.fallback_reason: str | None = None if getattr(method, "vectorizable", True) else \
            f"method {method.name} is marked not vectorizable"
        if self.fallback_reason:
            print(f"fedskew: vectorized executor falls back to sequential: {self.fallback_reason}.", flush=True)
        self._checked = False
        self.peak_state_bytes = 0
        self.peak_device_bytes = 0
        self._int_buffers = {k: v for k, v in model.named_buffers() if not v.is_floating_point()}
        self._frozen = frozen_forward(model)
        self._losses = vmap(self._loss(method.local_loss), in_dims=(0, 0, 0, 0, None, 0))
        self._personal_losses = vmap(self._loss(method.personal_loss), in_dims=(0, 0, 0, 0, None, 0))
        self._eval = vmap(self._logits, in_dims=(0, 0))

    # -- pure pieces -------------------------------------------------------------------------------
    def _loss(self, loss_fn):
        """One client's (loss, aux) for ``loss_fn`` (``local_loss`` or ``personal_loss``), to vmap."""
        def loss(params, buffers, x, y, payload, client_state):
            def train_fn(inp):
                return functional_call(self.model, {**params, **buffers}, (inp,), {"return_features": True})

            def head_fn(h):
                own = {k[len("classifier."):]: v for k, v in {**params, **buffers}.items() if k.startswith("classifier.")}
                return functional_call(self.model.classifier, own, (h,))

            def call_fn(state, inp):
                return functional_call(self.model, {**buffers, **state}, (inp,), {"return_features": True})

            def eval_fn(inp):
                return in_eval_mode(self.model, lambda: functional_call(
                    self.model, {**params, **snapshot(buffers)}, (inp,), {"return_features": True}))

            fwd = Forward(train_fn, self._frozen, head_fn, call_fn, buffers, eval_fn)
            return loss_fn(fwd, params, x, y, payload, client_state)
        return loss

    def _logits(self, state, x):
        return functional_call(self.model, state, (x,))

    # -- helpers -----------------------------------------------------------------------------------
    def chunk_size(self, num_clients: int) -> int:
        if self.max_parallel_clients:
            return min(self.max_parallel_clients, num_clients)
        per_client = 4 * sum(p.numel() * p.element_size() for p in self.model.parameters())
        return max(1, min(num_clients, _device_memory(self.device) // 4 // max(per_client, 1)))

    @torch.no_grad()
    def local_accuracies(self, states: State, clients: list[int]) -> list[float | None]:
        """Each client's state on its own local test split, all clients in one vmapped eval pass
        (test sets padded to the longest and masked; eval mode, so padding cannot leak)."""
        lengths = [len(self.test_idx[k]) for k in clients]
        longest = max(lengths)
        if longest == 0:
            return [None] * len(clients)
        rows = torch.zeros(len(clients), longest, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(clients), longest, dtype=torch.bool, device=self.device)
        for i, k in enumerate(clients):
            rows[i, :lengths[i]] = self.test_idx[k]
            mask[i, :lengths[i]] = True
        was_training = self.model.training
        self.model.eval()
        try:
            preds = self._eval(states, self.x[rows]).argmax(-1)
        finally:
            self.model.train(was_training)
        correct = ((preds == self.y[rows]) & mask).sum(1)
        return [correct[i].item() / n if n else None for i, n in enumerate(lengths)]

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
        size = self.chunk_size(len(clients))
        results = []
        for i in range(0, len(clients), size):
            results += self._train_chunk(round_idx, clients[i:i + size], payload, client_states, lr)
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
        s, method = self.settings, self.method
        # Clients sorted by local size: those that share a batch size at a step are then mostly a
        # contiguous range of the stack, trained through views with no gather or scatter.
        given_order = {k: i for i, k in enumerate(clients)}
        clients = sorted(clients, key=lambda k: len(self.train_idx[k]))
        client_states = {k: self.sequential.prepare(round_idx, k, payload, client_states[k]) for k in clients}
        starts = [method.local_start(payload, client_states[k]) for k in clients]
        acc_before = self.local_accuracies(self._stack_starts(starts), clients)
        plans = [stage_schedules(s, method, round_idx, k, len(self.train_idx[k]), lr) for k in clients]
        reports = []
        for k, plan in zip(clients, plans):
            idx = self.train_idx[k]
            reports.append(ClientReport(k, len(idx), len(plan[0]), lr, s.momentum,
                                        feature_fn(self.model, self.x[idx], self.y[idx]),
                                        bn_recalibration_fn(self.model, self.x[idx], s.batch_size)))
        aux: list[dict] = [{} for _ in clients]

        def personal_stage(trained: list[State], states: list[State]) -> list[State]:
            """The personalisation stage of every client from ``trained``; their new states."""
            if len({p[2] for p in plans}) > 1:
                raise ValueError("clients of one round differ in their personalisation learning rate")
            begin = [method.personal_start(t, payload, st) for t, st in zip(trained, states)]
            personal_all, psums, psteps = self._run_stage(
                self._personal_losses, self._stack_starts(begin), stack_states(states), [p[1] for p in plans],
                clients, payload, plans[0][2], method.trained_params("personal"), (round_idx, 1))
            out = []
            for i, st in enumerate(states):
                aux[i].update({f"personal_{key}": (v[i] / max(int(psteps[i]), 1)).item() for key, v in psums.items()})
                out.append(method.after_personal(unstack(personal_all, i), payload, st, reports[i])
                           if psteps[i] else st)
            return out

        has_personal = any(p[1] for p in plans)
        states = [client_states[k] for k in clients]
        if has_personal and method.personal_first:
            states = personal_stage(starts, states)
            starts = [method.local_start(payload, st) for st in states]
        stacked_states = stack_states(states)
        correction = self._correction(payload, stacked_states)
        trained_all, sums, steps = self._run_stage(self._losses, self._stack_starts(starts), stacked_states,
                                                   [p[0] for p in plans], clients, payload, lr,
                                                   method.trained_params("upload"), (round_idx, 0), correction)
        trained = [unstack(trained_all, i) for i in range(len(clients))]  # views; methods never write in place
        results = []
        for i, k in enumerate(clients):
            upload, new_state = method.after_training(trained[i], payload, states[i], reports[i])
            means = {key: (v[i] / max(int(steps[i]), 1)).item() for key, v in sums.items()}
            results.append(ClientResult(k, upload, new_state, reports[i], means.pop("loss"), acc_before[i], None,
                                        {**aux[i], **means}))
        if has_personal and not method.personal_first:
            new_states = personal_stage(trained, [r.client_state for r in results])
            for i, r in enumerate(results):
                r.client_state = new_states[i]
                r.aux.update(aux[i])
        personal = [method.personal_state(trained[i], r.client_state) for i, r in enumerate(results)]
        for r, acc in zip(results, self.local_accuracies(stack_states(personal), clients)):
            r.acc_after = acc
        return sorted(results, key=lambda r: given_order[r.client_id])

    def _correction(self, payload: State, cstates: State) -> State | None:
        """Every client's ``Method.step_correction``, stacked (None: the method has none)."""
        if self.method.step_correction(payload, unstack(cstates, 0)) is None:
            return None
        return vmap(self.method.step_correction, in_dims=(None, 0))(payload, cstates)

    def _run_stage(self, losses_fn, start: State, cstates: State, schedules: list[list[np.ndarray]],
                   clients: list[int], payload: State, lr: float, trainable: frozenset[str] | None = None,
                   round_stage: tuple[int, int] = (0, 0), correction: State | None = None):
        """Local SGD of every client of the chunk from the stacked ``start`` on its own batch
        schedule, updating the ``trainable`` parameters (None: all), batches augmented with the
        (round, stage) draws when augmentation is on, ``p -= lr * correction`` after every step
        (stacked ``Method.step_correction``); returns the stacked trained state
        (parameters and float buffers), the summed tracked values per client and each client's
        number of steps."""
        s = self.settings
        G = len(clients)
        param_names = [n for n, _ in self.model.named_parameters()]
        params = {n: start[n].clone() for n in param_names}
        buffers = {n: v.clone() for n, v in start.items() if n not in params}
        buffers.update({n: v.unsqueeze(0).repeat(G, *[1] * v.dim()) for n, v in self._int_buffers.items()})
        updated = [n for n in param_names if trainable is None or n in trainable]
        momentum = {n: torch.zeros_like(params[n]) for n in updated} if s.momentum else None
        state_bytes = sum(t.numel() * t.element_size() for t in [*params.values(), *buffers.values()]) * 4
        self.peak_state_bytes = max(self.peak_state_bytes, state_bytes)

        # Batch schedules exactly as the sequential executor's; sizes[i, step] = 0 once finished.
        steps = np.array([len(sc) for sc in schedules])
        sizes = np.zeros((G, max(int(steps.max()), 1)), dtype=np.int64)
        rows, offsets = [], []
        for i, (k, sched) in enumerate(zip(clients, schedules)):
            sizes[i, :len(sched)] = [len(b) for b in sched]
            picked = np.concatenate(sched) if sched else np.zeros(0, dtype=np.int64)
            rows.append(self.train_idx[k][torch.from_numpy(picked).to(self.device)])
            offsets.append(np.concatenate([[0], np.cumsum(sizes[i, :len(sched)])]))
        augs = [s.augmentation(round_stage[0], k, round_stage[1], len(r)) for k, r in zip(clients, rows)]

        sums: dict[str, torch.Tensor] = {}
        self.model.train()
        for step in range(sizes.shape[1]):
            for size in np.unique(sizes[:, step]):
                if size == 0:
                    continue
                members = np.flatnonzero(sizes[:, step] == size)
                batch_rows = torch.stack([rows[i][offsets[i][step]:offsets[i][step] + size] for i in members])
                x = self.x[batch_rows]
                if s.augment_pad:
                    draws = torch.stack([augs[i][offsets[i][step]:offsets[i][step] + size] for i in members])
                    x = crop_flip(x, draws, s.augment_pad)
                a, b = int(members[0]), int(members[-1]) + 1
                if b - a == len(members):  # contiguous: views, updated in place
                    gi = None
                    pick = (lambda d: {k: v[a:b] for k, v in d.items()})
                else:  # scattered: gathered copies, written back after the step
                    gi = torch.from_numpy(members).to(self.device)
                    pick = (lambda d: {k: v.index_select(0, gi) for k, v in d.items()})
                p, buf, mom = pick(params), pick(buffers), pick(momentum) if momentum else None
                leaves = {k: v.detach().requires_grad_(k in updated) for k, v in p.items()}
                losses, aux = losses_fn(leaves, buf, x, self.y[batch_rows], payload, pick(cstates))
                tracked = {"loss": losses, **aux}
                for key, v in tracked.items():
                    sums.setdefault(key, torch.zeros(G, device=self.device))
                grads = torch.autograd.grad(losses.sum(), [leaves[k] for k in updated], allow_unused=True,
                                            materialize_grads=True)
                # Each client's loss depends only on its own row of the stack, so the gradient of
                # the sum is every client's own gradient.
                self._sgd_({k: p[k] for k in updated}, dict(zip(updated, grads)), mom, lr)
                if correction:
                    with torch.no_grad():
                        corr = pick(correction)
                        torch._foreach_add_([p[k] for k in updated if k in corr],
                                            [corr[k] for k in updated if k in corr], alpha=-lr)
                if gi is None:
                    for key, v in tracked.items():
                        sums[key][a:b] += v.detach()
                else:
                    with torch.no_grad():
                        for d, new in ((params, p), (buffers, buf), (momentum, mom)):
                            for k in (new or {}):
                                d[k].index_copy_(0, gi, new[k])
                    for key, v in tracked.items():
                        sums[key].index_add_(0, gi, v.detach())
        if self.device.type == "cuda":
            self.peak_device_bytes = max(self.peak_device_bytes, torch.cuda.max_memory_allocated(self.device))
        return {**params, **{k: v for k, v in buffers.items() if v.is_floating_point()}}, sums, steps

    @torch.no_grad()
    def _sgd_(self, params: State, grads: State, momentum: State | None, lr: float) -> None:
        """One torch.optim.SGD step (dampening 0, no Nesterov) for every client at once, in place
        on ``params`` and ``momentum``."""
        s = self.settings
        names = list(params)
        g = [grads[n] for n in names]
        if s.grad_clip is not None:
            norms = torch.sqrt(sum(t.pow(2).flatten(1).sum(1) for t in g))
            coef = torch.clamp(s.grad_clip / (norms + 1e-6), max=1.0)
            g = [t * coef.view(-1, *[1] * (t.dim() - 1)) for t in g]
        p = [params[n] for n in names]
        if s.weight_decay:
            torch._foreach_add_(g, p, alpha=s.weight_decay)
        if momentum is not None:
            m = [momentum[n] for n in names]
            torch._foreach_mul_(m, s.momentum)
            torch._foreach_add_(m, g)
            g = m
        torch._foreach_add_(p, g, alpha=-lr)
