"""Runs as lanes of one program: several runs train their selected clients as one stacked step.

The vectorised executor stacks one run's clients on a leading dimension. A :class:`Pack` stacks
the clients of several runs the same way: each lane is a (run, client) pair. Runs of a pack share
the model architecture, the data set's shapes, the method and its options that shape the step
(everything but float options), and the local training settings but the seed; they may differ in
seed, partition, learning rate, number of rounds and clients per round, and float method options.

What stays per run: everything outside the stacked local step. Each run is an ordinary
:class:`~fedskew.engine.runner.Experiment` (its own run directory, lock, metrics, checkpoints,
resume, server state, client sampling, ``prepare``, aggregation, evaluation), executed in its own
thread. The threads take turns (one runs at a time, in a fixed order, so every run's host code
sees exactly what it would see alone) and each parks when it asks for a stage (``run_stage``);
when all have parked or ended, the pack trains the parked stages of the same shape as one call of
:meth:`LaneExecutor.train_requests`, then lets them go on.

Inside that call every lane carries its own run's payload, learning rate (one value per lane
where they differ), data rows (the runs' data tables side by side; one table when the runs share
their data) and, for the float options that differ between runs, its run's values as tensors
(:func:`~fedskew.algorithms.compose.lane_options`). The first merged call of each stage checks,
for one lane of every run, that the lane's loss and tracked values equal those of the run's own
method on the same batch (a method that reads an option outside ``self.opt``, or derives state
from one at construction, fails it); a pack whose check fails, or whose merged call raises, trains
its runs one call per run from then on, with a one-line notice, so results never differ from the
runs alone beyond float round-off. A run that fails (a NaN loss) ends with its own error; the others
go on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import numpy as np
import torch

from fedskew.algorithms.base import State
from fedskew.algorithms.compose import option_holders
from fedskew.engine.durable import STOP
from fedskew.engine.vectorized import StageRequest, VectorizedExecutor


class LaneMismatch(ValueError):
    """A merged call's lane computes something other than its run alone would."""


def shapes(state: State) -> tuple:
    return tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in state.items()))


def signature(r: StageRequest) -> tuple:
    """What requests trained in one call must share: the stage, the shapes of every stacked state
    (but the lane count) and of the payload, the trained parameters, and the step's kind."""
    def per_lane(st):
        return tuple((k, s[1:], d) for k, s, d in shapes(st))
    return (r.stage, per_lane(r.start), per_lane(r.cstates), shapes(r.payload), r.trainable,
            None if r.correction is None else per_lane(r.correction), r.padded, repr(r.sam),
            None if r.pairs is None else tuple(r.pairs[0][1].shape[1:]), r.augs is not None,
            tuple(r.executor.x.shape[1:]), r.executor.x.dtype, replace(r.executor.settings, seed=0),
            type(r.executor.method))


def option_values(method) -> dict[str, dict]:
    """Every option of a method, by holder path (:func:`option_holders`)."""
    return {path: dict(obj.opt) for path, obj in option_holders(method)}


def lane_option_plan(methods: list) -> dict[str, dict[str, list[float]]]:
    """The float options whose values differ between ``methods`` (path -> option -> values); a
    difference in any other option is a ValueError (such runs belong to different packs)."""
    tables = [option_values(m) for m in methods]
    plan: dict[str, dict[str, list[float]]] = {}
    for path, first in tables[0].items():
        for key, value in first.items():
            values = [t[path][key] for t in tables]
            if all(v == value for v in values):
                continue
            if not all(isinstance(v, float) for v in values):
                raise ValueError(f"runs of a pack differ in method option {key!r} ({values[0]!r} vs "
                                 f"{next(v for v in values if v != value)!r}); only float options may differ")
            plan.setdefault(path, {})[key] = values
    return plan


@dataclass
class Merged:
    """The inputs of one stacked call over the lanes of several requests."""

    stage: str
    start: State
    cstates: State
    schedules: list
    rows: list
    x: torch.Tensor
    y: torch.Tensor
    payload: State
    lr: object
    trainable: object
    augs: torch.Tensor | None
    correction: State | None
    padded: bool
    sam: object
    pairs: list | None
    options: dict | None
    check: object
    fixed: frozenset  # keys of the start that are not the runs' state (dropped from the result)
    gens: list | None  # each lane's dropout generator


def merge_requests(template: VectorizedExecutor, requests: list[StageRequest], check: bool = False) -> Merged:
    """One call's inputs from ``requests`` of one :func:`signature`, lanes in request order; with
    ``check``, a :class:`LaneCheck` of every request's lanes on the first step."""
    sizes = [len(r.rows) for r in requests]
    def cat(states):
        return {k: torch.cat([st[k] for st in states]) for k in states[0]}
    def per_lane(value, n):
        return value.unsqueeze(0).expand(n, *value.shape)
    x, y, offsets = data_tables(template, [r.executor for r in requests])
    device = template.device
    rows = [idx + off for r, off in zip(requests, offsets) for idx in r.rows]
    payload = {k: torch.cat([per_lane(r.payload[k], n) for r, n in zip(requests, sizes)]) for k in requests[0].payload}
    lr = torch.tensor(np.repeat([r.lr for r in requests], sizes), dtype=template._dtype, device=device)
    plan = lane_option_plan([r.executor.method for r in requests])
    options = {path: {key: torch.tensor(np.repeat(values, sizes), dtype=template._dtype, device=device)
                      for key, values in fields.items()} for path, fields in plan.items()} or None
    first = requests[0]
    pairs = [p for r in requests for p in r.pairs] if first.pairs is not None else None
    # fixed architecture tensors (the ETF head, drawn from each run's seed) travel per lane
    fixed = frozenset(getattr(template.model, "fixed_keys", ()))
    starts = [{**r.start, **{k: per_lane(dict(r.executor.model.named_buffers())[k], n) for k in fixed}}
              for r, n in zip(requests, sizes)]
    return Merged(first.stage, cat(starts), cat([r.cstates for r in requests]),
                  [s for r in requests for s in r.schedules], rows, x, y, payload, lr, first.trainable,
                  torch.cat([r.augs for r in requests]) if first.augs is not None else None,
                  cat([r.correction for r in requests]) if first.correction is not None else None,
                  first.padded, first.sam, pairs, options, LaneCheck(requests, sizes, fixed) if check else None, fixed,
                  [g for r in requests for g in r.gens] if first.gens is not None else None)


def data_tables(template: VectorizedExecutor, executors: list) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The runs' training data side by side (one table when they share it; kept while the runs
    stay the same) and each run's row offset in it."""
    distinct = list({id(e.x): e for e in executors}.values())
    key = tuple(id(e.x) for e in distinct)
    if getattr(template, "_tables", (None,))[0] != key:
        if len(distinct) == 1:
            x, y = distinct[0].x, distinct[0].y
        else:
            x, y = torch.cat([e.x for e in distinct]), torch.cat([e.y for e in distinct])
        starts = dict(zip(key, np.cumsum([0] + [len(e.x) for e in distinct[:-1]]).tolist()))
        template._tables = (key, x, y, starts)
    _, x, y, starts = template._tables
    return x, y, [starts[id(e.x)] for e in executors]


class LaneCheck:
    """The first step of a merged call: for one lane of each request, the loss and tracked values
    of the merged call equal the request's own method on that lane's batch (its own payload and
    option values, as a call with its run alone)."""

    def __init__(self, requests: list[StageRequest], sizes: list[int], fixed: frozenset = frozenset()):
        self.requests, self.fixed = requests, fixed  # (the run's own model holds its fixed tensors)
        self.lane_of = np.repeat(np.arange(len(requests)), sizes)
        self.pending = set(range(len(requests)))

    @property
    def done(self) -> bool:
        return not self.pending

    def __call__(self, members: np.ndarray, sizes: np.ndarray, got: dict, leaves, buf, x, y, c, masks=None) -> None:
        for j, lane in enumerate(members):
            r = int(self.lane_of[lane])
            if r not in self.pending:
                continue
            self.pending.discard(r)
            req, m = self.requests[r], sizes[j]
            m = None if m is None else int(m)  # (a padded step: the lane's own rows only)
            def one(d, j=j):
                return {k: v[j:j + 1] for k, v in d.items()}
            own = req.executor.losses(req.stage, masks=masks is not None)
            if masks is not None:
                req.executor._mask_blocks = self.requests[0].executor._mask_blocks  # (the template drew them)
            with torch.no_grad():
                # (copies of the buffers: a train-mode forward updates BatchNorm statistics in place)
                loss, aux = own(one(leaves), {k: v.clone() for k, v in one(buf).items() if k not in self.fixed},
                                x[j:j + 1, :m], y[j:j + 1, :m], req.payload, one(c), None, None,
                                None if masks is None else masks[j:j + 1])
            for key, ref in {"loss": loss, **aux}.items():
                if key not in got or not torch.allclose(got[key][j:j + 1].detach(), ref, rtol=1e-4, atol=1e-6):
                    raise LaneMismatch(f"method {req.executor.method.name}'s '{key}' in a lane of the pack differs "
                                       f"from its run alone")


def split_result(out: tuple[State, dict, np.ndarray], sizes: list[int], drop=frozenset()
                 ) -> list[tuple[State, dict, np.ndarray]]:
    """A merged call's (trained stack, sums, steps) cut back into one per request (views), without
    the ``drop`` keys."""
    trained, sums, steps = out
    bounds = np.cumsum([0] + sizes)
    return [({k: v[a:b] for k, v in trained.items() if k not in drop}, {k: v[a:b] for k, v in sums.items()},
             steps[a:b])
            for a, b in zip(bounds[:-1], bounds[1:])]


class LaneExecutor(VectorizedExecutor):
    """A run's vectorised executor inside a :class:`Pack`: its stages wait for the pack, which
    trains them with the other runs' as lanes of one call."""

    def __init__(self, *args, pack: Pack, **kwargs):
        self.pack = pack
        super().__init__(*args, **kwargs)

    def train_requests(self, requests: list[StageRequest], check: bool = False) -> list[tuple[State, dict, np.ndarray]]:
        """Train the requests of several runs (or of this one alone: its arithmetic then is the
        same as beside others, the learning rate one tensor entry per lane) as one call, each lane
        with its own run's payload, learning rate, data rows and method option values; ``check``:
        verify each request's lanes against its run alone on the first step (:class:`LaneCheck`)."""
        m = merge_requests(self, requests, check)
        out = self._run_stage(m.stage, m.start, m.cstates, m.schedules, m.rows, m.x, m.y, m.payload, True, m.lr,
                              m.trainable, m.augs, m.correction, m.padded, m.sam, m.pairs, m.options, m.check, m.gens)
        return split_result(out, [len(r.rows) for r in requests], m.fixed)

    def run_stage(self, plan, starts, states, clients, payload, round_idx):
        request = self.stage_request(plan, starts, states, clients, payload, round_idx)
        return self.finish_request(request, *self.pack.submit(self, request))


class _Slot:
    """One run of a pack: its thread, and what passes between the thread and the pack."""

    def __init__(self, experiment, on_round):
        self.experiment, self.on_round = experiment, on_round
        self.go, self.parked = threading.Event(), threading.Event()
        self.request: StageRequest | None = None
        self.out = None
        self.result = None
        self.error: BaseException | None = None
        self.done = False
        self.thread: threading.Thread | None = None


class PackAborted(BaseException):
    """The pack stopped (an interrupt reached the process running it) while this run waited; not an
    Exception, so that no training fallback takes it for a failure."""


class Pack:
    """Runs whose selected clients train as lanes of one stacked program (module docstring).

    Build each run's :class:`~fedskew.engine.runner.Experiment` with ``pack=`` this object, then
    :meth:`run` them; each result is the run's ``RunResult`` or the exception that ended it."""

    def __init__(self, max_lanes: int | None = None):
        self.slots: dict[int, _Slot] = {}  # id(executor) -> slot
        self.merge = True  # False once a merged call failed its check: one call per run from then on
        self.reason: str | None = None
        self.calls = 0  # stacked calls made (merged or not), for tests and benchmarks
        self.checked: set = set()  # signatures whose first merged call checked its lanes (LaneCheck)
        self.stopping = False
        self.max_lanes = max_lanes

    def submit(self, executor: LaneExecutor, request: StageRequest):
        """In a run's thread: park with ``request`` until the pack has trained it."""
        slot = self.slots[id(executor)]
        slot.request = request
        slot.parked.set()
        slot.go.wait()
        slot.go.clear()
        out, slot.out = slot.out, None
        if isinstance(out, BaseException):
            raise out
        return out

    def run(self, experiments: list, on_round: list | None = None) -> list:
        slots = [_Slot(e, cb) for e, cb in zip(experiments, on_round or [None] * len(experiments))]
        for s in slots:
            self.slots[id(s.experiment.executor)] = s
        live = list(slots)
        try:
            while live:
                # a stop asked for by a signal (durable.STOP) is seen by every run in the same step of the
                # pack, so the runs stop after the same round and resume beside the same runs as before
                self.stopping = STOP.is_set()
                for s in live:
                    self._resume(s)
                live = [s for s in live if not s.done]
                parked = [s for s in live if s.request is not None]
                groups: dict[tuple, list[_Slot]] = {}
                for s in parked:
                    groups.setdefault(signature(s.request), []).append(s)
                for group in groups.values():
                    self._train(group)
        except BaseException:
            for s in live:  # every waiting run unwinds (its folder lock released), then the interrupt goes on
                if s.thread is not None and not s.done:
                    s.out = PackAborted("the pack was interrupted")
                    self._resume(s)
                    s.thread.join(timeout=60)
            raise
        finally:
            for s in slots:
                self.slots.pop(id(s.experiment.executor), None)
        return [s.error if s.error is not None else s.result for s in slots]

    def _resume(self, slot: _Slot) -> None:
        """Let one run's thread go on until it parks again or ends (only one runs at a time)."""
        slot.request = None
        slot.parked.clear()
        if slot.thread is None:
            slot.thread = threading.Thread(target=self._body, args=(slot,), daemon=True,
                                           name=f"fedskew-lane-{slot.experiment.run_dir.name}")
            slot.thread.start()
        slot.go.set()
        slot.parked.wait()

    @staticmethod
    def _body(slot: _Slot) -> None:
        slot.go.wait()
        slot.go.clear()
        try:
            slot.result = slot.experiment.run(slot.on_round)
        except BaseException as exc:  # the run's own error (a NaN loss, a full disk): the others go on
            slot.error = exc
        finally:
            slot.done = True
            slot.parked.set()

    def _train(self, group: list[_Slot]) -> None:
        """The parked requests of ``group`` (one signature) as merged calls of at most
        ``max_lanes`` lanes, or one call per run; each run gets its result or its error. A merged
        call that runs out of device memory is retried with half the lanes, which stay halved."""
        chunks, lanes = [[]], 0
        for s in group:
            n = len(s.request.rows)
            if chunks[-1] and self.max_lanes and lanes + n > self.max_lanes:
                chunks.append([])
                lanes = 0
            chunks[-1].append(s)
            lanes += n
        for chunk in chunks:
            if not (self.merge and len(chunk) > 1):
                self._alone(chunk)
                continue
            stage, out_of_memory = signature(chunk[0].request), False
            try:
                outs = chunk[0].experiment.executor.train_requests(
                    [s.request for s in chunk], stage not in self.checked
                )
            except torch.OutOfMemoryError:
                out_of_memory = True  # retried below: here the error's traceback still holds the failed call's tensors
            except (RuntimeError, ValueError, NotImplementedError) as exc:
                self.merge = False
                self.reason = str(exc).splitlines()[0][:200]
                print(f"fedskew: the runs of a pack train one call per run from here: {self.reason}", flush=True)
                self._alone(chunk)
                continue
            if out_of_memory:
                lanes = sum(len(s.request.rows) for s in chunk)
                self.max_lanes = max(1, lanes // 2)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                print(f"fedskew: out of device memory with {lanes} lanes stacked; packs continue with at most "
                      f"{self.max_lanes} lanes a call.", flush=True)
                self._train(chunk)
                continue
            self.calls += 1
            self.checked.add(stage)
            for s, out in zip(chunk, outs):
                s.out = out

    def _alone(self, chunk: list[_Slot]) -> None:
        """Each run's request as a call of its own (exactly its vectorised executor's)."""
        for s in chunk:
            try:
                s.out = s.experiment.executor.train_requests([s.request])[0]
                self.calls += 1
            except BaseException as exc:  # the run's own failure, raised in its thread
                s.out = exc


__all__ = ["LaneExecutor", "LaneMismatch", "Pack", "PackAborted", "lane_option_plan", "merge_requests",
           "split_result"]
