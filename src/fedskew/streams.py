"""Named random streams derived from the experiment seed.

Every random choice in a run (partition, client sampling, batch order, model initialisation,
anchors, ...) draws from its own stream ``(seed, name, *ints)``. Streams are independent of each
other, so two methods under one seed see the same partition, the same client schedule and the
same batch order, and a resumed run continues exactly. numpy's SeedSequence + PCG64 gives the
same numbers on every platform.
"""

from __future__ import annotations

import contextlib
import zlib

import numpy as np
import torch


def stream_key(seed: int, name: str, *ints: int) -> list[int]:
    """The SeedSequence entropy of stream ``name`` (crc32 of the name: stable across processes)."""
    return [int(seed), zlib.crc32(name.encode()), *(int(i) for i in ints)]


def numpy_rng(seed: int, name: str, *ints: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(stream_key(seed, name, *ints)))


def torch_seed(seed: int, name: str, *ints: int) -> int:
    """A 63-bit integer seed for torch generators, derived from the named stream."""
    return int(np.random.SeedSequence(stream_key(seed, name, *ints)).generate_state(2, np.uint32)
               .astype(np.uint64).dot(np.array([1, 1 << 31], dtype=np.uint64)))


def sample_clients(seed: int, round_idx: int, num_clients: int, per_round: int) -> list[int]:
    """The clients selected in a round: a function of (seed, round) only, sorted."""
    if per_round >= num_clients:
        return list(range(num_clients))
    rng = numpy_rng(seed, "client_sampling", round_idx)
    return sorted(int(i) for i in rng.choice(num_clients, size=per_round, replace=False))


def held_out_clients(seed: int, num_clients: int, fraction: float) -> list[int]:
    """The clients that never train (stream ``held_out``): round(fraction * num_clients) of them,
    drawn once per seed, sorted; scored on what the final model and each method's personalisation
    give a client never trained on (``unseen/*``)."""
    count = int(round(fraction * num_clients))
    if count == 0:
        return []
    return sorted(int(k) for k in numpy_rng(seed, "held_out").choice(num_clients, size=count, replace=False))


def dropped_clients(seed: int, round_idx: int, selected: list[int], fraction: float) -> list[int]:
    """The selected clients that drop out of a round after receiving the model (stream
    ``client_dropout``): each with probability ``fraction``, a function of (seed, round, client)
    only; at least one stays (of all drawn to drop, the one with the highest draw)."""
    if fraction <= 0 or not selected:
        return []
    draws = {k: numpy_rng(seed, "client_dropout", round_idx, k).random() for k in selected}
    dropped = [k for k in selected if draws[k] < fraction]
    if len(dropped) == len(selected):
        dropped.remove(max(selected, key=lambda k: (draws[k], -k)))
    return dropped


def straggler_steps(seed: int, round_idx: int, client_id: int, fraction: float, steps: int) -> int:
    """A client's local steps in a round where a ``fraction`` of clients straggle (stream
    ``stragglers``): with probability ``fraction`` a number drawn uniformly from 1 .. steps - 1
    (fewer than its ``steps``, FedProx's systems heterogeneity in steps instead of epochs), else
    ``steps``; a function of (seed, round, client) only."""
    if fraction <= 0 or steps <= 1:
        return steps
    rng = numpy_rng(seed, "stragglers", round_idx, client_id)
    return int(rng.integers(1, steps)) if rng.random() < fraction else steps


def batch_order(seed: int, round_idx: int, client_id: int, num_samples: int, epochs: int) -> list[np.ndarray]:
    """One permutation of the client's local indices per local epoch."""
    rng = numpy_rng(seed, "batch_order", round_idx, client_id)
    return [rng.permutation(num_samples) for _ in range(epochs)]


def dropout_generator(seed: int, round_idx: int, client_id: int, stage: int) -> torch.Generator:
    """The CPU generator of a client's dropout masks in one stage of a round (stream ``dropout``)."""
    return torch.Generator().manual_seed(torch_seed(seed, "dropout", round_idx, client_id, stage))


@contextlib.contextmanager
def seeded_torch(seed: int, name: str = "model_init", *ints: int):
    """Run a block with the global torch RNG seeded from a stream; the outer state is restored."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(seed, name, *ints))
        yield
