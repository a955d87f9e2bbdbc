"""A federation: one data set in memory plus, per client, index sets into it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fedskew.data.datasets import Dataset
from fedskew.data.partitions import local_test_split, partition_labels
from fedskew.data.sources import load_dataset
from fedskew.streams import numpy_rng


@dataclass(frozen=True)
class Federation:
    """The data set and, per client, its local train and local test indices into ``x_train``."""

    data: Dataset
    train_idx: list[torch.Tensor]
    test_idx: list[torch.Tensor]
    # a method's local validation split, held out of training (FedFOMO's D_val); None: none
    val_idx: list[torch.Tensor] | None = None

    def with_validation(self, fraction: float, seed: int) -> Federation:
        """The same federation with ``fraction`` of every client's training indices (drawn from the
        seed, stream ``validation_split``; at least one sample when the client has two or more)
        moved to a local validation split that training never sees."""
        train, val = [], []
        for k, idx in enumerate(self.train_idx):
            n_val = min(max(int(round(fraction * len(idx))), 1), len(idx) - 1) if len(idx) > 1 else 0
            order = torch.from_numpy(numpy_rng(seed, "validation_split", k).permutation(len(idx)))
            val.append(idx[order[:n_val]].sort().values)
            train.append(idx[order[n_val:]].sort().values)
        return Federation(self.data, train, self.test_idx, val)

    @property
    def num_clients(self) -> int:
        return len(self.train_idx)

    @property
    def num_classes(self) -> int:
        return self.data.num_classes

    def counts(self, split: str = "train") -> np.ndarray:
        """Clients x classes sample counts of the local train (or local test) sets."""
        idx = self.train_idx if split == "train" else self.test_idx
        y = self.data.y_train.numpy()
        return np.stack([np.bincount(y[i.numpy()], minlength=self.num_classes) for i in idx])

    def client_class_counts(self, client: int) -> torch.Tensor:
        return torch.bincount(self.data.y_train[self.train_idx[client]], minlength=self.num_classes)

    def summary_rows(self) -> list[dict]:
        tr, te = self.counts("train"), self.counts("test")
        return [{"client": k, "train": int(tr[k].sum()), "local_test": int(te[k].sum()),
                 "classes": [int(c) for c in np.flatnonzero(tr[k])],
                 "counts": {int(c): int(tr[k, c]) for c in np.flatnonzero(tr[k])}}
                for k in range(self.num_clients)]

    def heatmap(self, title: str = ""):
        """Clients x classes training counts (FedMR Fig. 6 / FedKA Fig. 7 style) as a matplotlib
        figure (``fedskew.engine.durable.save_png`` writes it)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        counts = self.counts("train")
        k, c = counts.shape
        fig, ax = plt.subplots(figsize=(min(2 + 0.5 * c, 14), min(1.5 + 0.25 * k, 14)))
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")  # classes not held stay blank
        im = ax.imshow(np.ma.masked_equal(counts, 0), aspect="auto", cmap=cmap, interpolation="nearest",
                       vmin=0, vmax=max(int(counts.max()), 1))
        ax.set_xlabel("class")
        ax.set_ylabel("client")
        ax.set_xticks(range(0, c, 1 if c <= 30 else 5))  # FEMNIST's 62 labels would overlap
        if k <= 40:
            ax.set_yticks(range(k))
        if k * c <= 400:
            for i in range(k):
                for j in range(c):
                    if counts[i, j]:
                        ax.text(j, i, str(counts[i, j]), ha="center", va="center", fontsize=7,
                                color="white" if counts[i, j] < counts.max() / 2 else "black")
        fig.colorbar(im, ax=ax, label="training samples")
        ax.set_title(title or f"{self.data.name}: {k} clients x {c} classes")
        fig.tight_layout()
        return fig


def build_federation(data: Dataset, partition_cfg, seed: int) -> Federation:
    """Partition ``data`` with the seed's ``partition`` stream and carve each client's local test
    split with its ``local_split`` stream."""
    labels = data.y_train.numpy()
    groups = data.train_groups.numpy() if data.train_groups is not None else None
    parts = partition_labels(partition_cfg, labels, data.num_classes, numpy_rng(seed, "partition"), groups)
    train, test = [], []
    for k, idx in enumerate(parts):
        tr, te = local_test_split(idx, partition_cfg.local_test_fraction, numpy_rng(seed, "local_split", k))
        train.append(torch.from_numpy(tr.astype(np.int64)))
        test.append(torch.from_numpy(te.astype(np.int64)))
    return Federation(data, train, test)


def load_federation(cfg) -> Federation:
    """Data set + partition of a full :class:`fedskew.config.RunConfig`."""
    return build_federation(load_dataset(cfg.dataset, cfg.seed), cfg.partition, cfg.seed)


def public_samples(fed: Federation, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One training sample per class drawn once from the seed (stream ``public_samples``): the
    minimal shared set FedKA assumes every client knows (``FederationInfo.public_samples``); None
    when some class has no training sample (Shakespeare's rare characters)."""
    rng = numpy_rng(seed, "public_samples")
    y = fed.data.y_train.numpy()
    picks = [int(rng.choice(np.flatnonzero(y == c))) if (y == c).any() else -1 for c in range(fed.num_classes)]
    if min(picks) < 0:
        return None
    idx = torch.tensor(picks)
    return fed.data.x_train[idx].to(device), fed.data.y_train[idx].to(device)


class PublicPoolError(ValueError):
    """A method asked for a public pool this federation does not have (one sentence)."""


def public_pool(fed: Federation, seed: int, device: torch.device) -> Callable[[str], torch.Tensor]:
    """``source -> x``: the inputs of the pooled ``train`` set, of the global ``validation``
    hold-out (``dataset.validation_fraction``) or of the global ``test`` set, without labels, in an
    order drawn once from the seed (stream ``public_unlabelled_<source>``); a method takes its
    public set as the first n (``FederationInfo.public_pool``)."""
    def draw(source: str) -> torch.Tensor:
        x = {"test": fed.data.x_test, "train": fed.data.x_train, "validation": fed.data.x_val}[source]
        if x is None or len(x) == 0:
            raise PublicPoolError(f"a public set from the '{source}' pool needs dataset.validation_fraction > 0 (the "
                                  f"global validation hold-out); it is 0 in this run")
        order = numpy_rng(seed, f"public_unlabelled_{source}").permutation(len(x))
        return x[torch.from_numpy(order)].to(device)
    return draw
