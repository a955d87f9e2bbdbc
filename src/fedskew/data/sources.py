"""Which loader builds a data set: :func:`load_dataset` from a ``dataset`` config section, each
data set read from files decoded once per process (keyed by its files' names, sizes and times),
then the run's own views of it (undone normalisation, subsamples, the validation hold-out). The
loaders live in :mod:`~fedskew.data.datasets` (digits, synthetic, MNIST-format IDX files),
:mod:`~fedskew.data.vision` (CIFAR, SVHN, CINIC-10, Tiny ImageNet) and :mod:`~fedskew.data.leaf`.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch

from fedskew.data.datasets import (
    _IDX_NORMALISATION,
    Dataset,
    DatasetError,
    hold_out_validation,
    load_digits,
    load_idx_dataset,
    make_synthetic,
    subsample,
)
from fedskew.data.leaf import load_leaf
from fedskew.data.vision import _STATS, load_cifar, load_cinic10, load_svhn, load_tinyimagenet

# Each data set's loader. Its positional parameters other than FROM_RUN are keys of the ``dataset``
# section of the same name (keyword-only ones are not configurable), and ``normalize`` applies where
# the loader normalises (NORMALISED): what DatasetConfig.applies() accepts is read from here.
LOADERS = {"digits": load_digits, "synthetic": make_synthetic, "mnist": load_idx_dataset, "fmnist": load_idx_dataset,
           "cifar10": load_cifar, "cifar100": load_cifar, "svhn": load_svhn, "femnist": load_leaf,
           "shakespeare": load_leaf, "cinic10": load_cinic10, "tinyimagenet": load_tinyimagenet}
DATASETS = tuple(LOADERS)
FROM_RUN = frozenset({"name", "seed"})
NORMALISED = {**_IDX_NORMALISATION, **_STATS}  # per-channel (mean, std) a loader normalises with


def _config_params(load) -> list[str]:
    return [n for n, p in inspect.signature(load).parameters.items() if p.kind is not p.KEYWORD_ONLY]


def dataset_keys(name: str) -> set[str]:
    """The ``dataset`` section's keys that data set ``name``'s loader reads (its signature), and
    ``normalize`` where the loader normalises."""
    return set(_config_params(LOADERS[name])) - FROM_RUN | ({"normalize"} if name in NORMALISED else set())


def load_dataset(cfg, seed: int) -> Dataset:
    """Build the data set named by a :class:`fedskew.config.DatasetConfig`. A data set read from
    files is decoded once per process and shared by every run that reads it (the last
    ``DECODED_KEPT`` kept: a sweep worker or a pack serves many runs of one data set); what a run
    derives from it (subsamples, hold-outs) is its own."""
    if cfg.name not in LOADERS:
        raise DatasetError(f"dataset.name '{cfg.name}' is not known; allowed: {list(DATASETS)}.")
    load = LOADERS[cfg.name]
    if "root" not in _config_params(load):  # made (digits, synthetic), not read from files
        data = load(**{p: seed if p == "seed" else getattr(cfg, p) for p in _config_params(load)})
    else:
        root = cfg.root or os.environ.get("FEDSKEW_DATA")
        stamp = _stamp(root) if root else None  # (files found elsewhere, or downloaded: not kept)
        data = (_decoded if stamp is not None else _decoded.__wrapped__)(cfg.name, cfg.root, cfg.download, stamp)
    if not getattr(cfg, "normalize", True):
        data = unnormalised(data)
    data = subsample(data, cfg.train_subsample, cfg.test_subsample, seed)
    return hold_out_validation(data, cfg.validation_fraction, seed) if cfg.validation_fraction else data


DECODED_KEPT = 2


STAMP_FILES = 20_000  # a folder with more files (CINIC-10, Tiny ImageNet) is decoded every time instead


def _stamp(root: str | None) -> tuple | None:
    """The names, sizes and modification times of every file under ``root``: a changed or replaced
    file is decoded again. None (decode, do not keep) past :data:`STAMP_FILES` files."""
    out = []
    if root:
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                try:
                    st = os.stat(os.path.join(folder, name))
                except OSError:
                    continue
                out.append((os.path.join(folder, name), st.st_size, st.st_mtime_ns))
                if len(out) > STAMP_FILES:
                    return None
    return tuple(out)


@functools.lru_cache(maxsize=DECODED_KEPT)
def _decoded(name: str, root: str | None, download: bool, stamp: tuple) -> Dataset:
    """A data set decoded from its files (kept: :func:`load_dataset`, ``stamp`` the files' state);
    never changed in place."""
    given = {"name": name, "root": root, "download": download}
    return LOADERS[name](**{p: given[p] for p in _config_params(LOADERS[name])})


def unnormalised(data: Dataset) -> Dataset:
    """The images as pixel / 255 in [0, 1] (torchvision's ToTensor alone, NIID-Bench's pipeline):
    the loader's per-channel normalisation undone (``dataset.normalize=false``)."""
    stats = _IDX_NORMALISATION.get(data.name) or _STATS.get(data.name)
    if stats is None:
        raise DatasetError(f"dataset.normalize = false applies to image data sets; '{data.name}' has no "
                           f"normalisation to undo.")
    mean, std = (torch.tensor(v, dtype=torch.float32).reshape(1, -1, 1, 1) for v in stats)

    def raw(x):
        return None if x is None else (x * std + mean).clamp_(0.0, 1.0)
    return Dataset(data.name, raw(data.x_train), data.y_train, raw(data.x_test), data.y_test, data.num_classes,
                   data.train_groups, data.group_names, raw(data.x_val), data.y_val)


__all__ = ["DATASETS", "LOADERS", "dataset_keys", "load_dataset", "unnormalised"]
