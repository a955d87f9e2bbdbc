"""One run's clients across processes: ``fedskew run ... distributed=true`` under ``torchrun``.

Rank 0 *is* the run: it samples clients, aggregates, evaluates and writes the run directory and its
checkpoints exactly as a single process does. Only the local training of a round's selected clients
is spread: rank 0 sends every other rank its shard of the round (clients ``r, r + N, ...`` of the
selection, their states, the payload and the learning rate) and trains its own; each rank trains its
shard with the run's executor (sequential or vectorised) and sends the results (uploads, new client
states, reports, accuracies) back to rank 0, which puts them in selection order (one gather path). ``Method.aggregate``
therefore sees what it sees in one process, for every method (weighted sums and method-specific
aggregates alike go through this one gather path). Client states live on rank 0 and travel with
their client for the round. Every random stream is named per client and round, so a client trains
the same on any rank: the run equals the single-process run (bit for bit with the sequential
executor; to float round-off with the vectorised one, whose batched kernels differ by shard).

Messages travel through a gloo group on the CPU whatever the main backend (gloo on CPU, nccl on
GPU): the float32 tensors of a message as one flat tensor, the rest pickled beside it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from fedskew.config import ConfigError
from fedskew.engine.protocol import Executor

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass
class Group:
    rank: int
    world: int
    local_rank: int
    objects: object  # the gloo process group objects travel through


def setup(device_name: str) -> Group:
    """Join the process group torchrun describes in the environment (idempotent)."""
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise ConfigError(f"distributed = true needs the process group torchrun describes ({', '.join(missing)} "
                          f"not set); start it as `torchrun --nproc_per_node=N -m fedskew.cli run ... "
                          f"distributed=true`, or set distributed=false.")
    local_rank = int(os.environ["LOCAL_RANK"])
    gpu = device_name.startswith("cuda") and torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(local_rank)  # "cuda" is this rank's GPU from here on
    if not dist.is_initialized():
        dist.init_process_group("nccl" if gpu else "gloo", timeout=timedelta(hours=2))
    objects = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
    return Group(dist.get_rank(), dist.get_world_size(), local_rank, objects)


def _map_leaves(obj, fn):
    """``obj`` with ``fn`` applied to every leaf inside dicts, lists, tuples and dataclasses."""
    if isinstance(obj, dict):
        return {k: _map_leaves(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_leaves(v, fn) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map_leaves(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    return fn(obj)


class _Slot:
    """Where a float32 tensor of a sent message lies in its flat buffer."""

    def __init__(self, offset: int, shape: tuple):
        self.offset, self.shape = offset, shape


def send(obj, dst: int, group) -> None:
    """``obj`` to rank ``dst``: its float32 tensors as one flat tensor message (gloo moves raw
    tensors about 3x faster than pickled ones: docs/scaling.md), the rest pickled beside it."""
    parts, at = [], [0]

    def slot(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if leaf.dtype != torch.float32:
            return leaf.cpu()
        parts.append(leaf.detach().reshape(-1).cpu())
        at[0] += leaf.numel()
        return _Slot(at[0] - leaf.numel(), tuple(leaf.shape))

    skeleton = _map_leaves(obj, slot)
    dist.send_object_list([skeleton, at[0]], dst=dst, group=group)
    if at[0]:
        dist.send(torch.cat(parts), dst=dst, group=group)


def recv(src: int, group, device: torch.device):
    """What ``send`` sent from rank ``src``, its tensors on ``device``."""
    box = [None, None]
    dist.recv_object_list(box, src=src, group=group)
    skeleton, n = box
    flat = torch.empty(n)
    if n:
        dist.recv(flat, src=src, group=group)
    flat = flat.to(device)

    def fill(leaf):
        if isinstance(leaf, _Slot):
            return flat[leaf.offset:leaf.offset + math.prod(leaf.shape)].reshape(leaf.shape).clone()
        return leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf

    return _map_leaves(skeleton, fill)


def portable(result):
    """A ClientResult that can travel to rank 0: its report's closures over this rank's model
    (``local_features``, ``recalibrate_bn``, ``local_data``: used on the client side only) are
    dropped."""
    return dataclasses.replace(result, report=dataclasses.replace(result.report, local_features=None,
                                                                   recalibrate_bn=None, local_data=None))


def _train_shard(executor, work):
    """Train one rank's shard; an exception travels back as its text instead of stopping the rank."""
    round_idx, clients, payload, states, lr = work
    try:
        return [portable(r) for r in executor.train_round(round_idx, clients, payload, states, lr)] if clients else []
    except Exception as exc:  # reported on rank 0, which retries the round the single-process way
        return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


class DistributedExecutor(Executor):
    """Rank 0's executor: the round's clients trained across the ranks (module docstring); what the
    runner reads (name, memory peaks, validation) is the executor's it spreads."""

    def __init__(self, inner: Executor, group: Group, device: torch.device):
        self.inner, self.group, self.device = inner, group, device
        self.name, self.validates = inner.name, inner.validates

    @property
    def sequential(self) -> Executor | None:  # the runner's per-client retry path: rank 0's own
        return self.inner.sequential

    @property
    def peak_state_bytes(self) -> int:
        return self.inner.peak_state_bytes

    @property
    def round_peak_bytes(self) -> int | None:
        return self.inner.round_peak_bytes

    @property
    def score_validation(self) -> bool:
        return self.inner.score_validation

    @score_validation.setter
    def score_validation(self, on: bool) -> None:
        self.inner.score_validation = on

    def train_round(self, round_idx, clients, payload, client_states, lr):
        g = self.group
        def shard(r):
            return (round_idx, clients[r::g.world], payload, {k: client_states[k] for k in clients[r::g.world]},
                                   lr)
        for r in range(1, g.world):  # the others start on their shards while rank 0 trains its own
            send(shard(r), r, g.objects)
        shards = [_train_shard(self.inner, shard(0))] + [recv(r, g.objects, self.device) for r in range(1, g.world)]
        errors = [s for s in shards if isinstance(s, str)]
        if errors:
            raise RuntimeError(f"a rank failed to train its clients ({errors[0]})")
        by_client = {res.client_id: res for s in shards for res in s}
        return [by_client[k] for k in clients]

    def stop(self) -> None:
        """Release the other ranks (they leave their serve loop)."""
        for r in range(1, self.group.world):
            send(None, r, self.group.objects)


def serve(executor, group: Group, device: torch.device) -> None:
    """Ranks > 0: train the shards rank 0 sends until it sends None."""
    while True:
        work = recv(0, group.objects, device)
        if work is None:
            return
        send(_train_shard(executor, work), 0, group.objects)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["DistributedExecutor", "Group", "recv", "send", "serve", "setup", "teardown"]
