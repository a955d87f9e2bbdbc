"""Datasets held once in memory as tensors.

Every loader returns a :class:`Dataset`: float32 images ``[N, C, H, W]`` (already normalised)
and int64 labels, for the official train and test splits. A federated client is an index set into
``x_train`` (see :mod:`fedskew.data.federated`), so no sample is ever copied per client.

Loaders never touch the network when the files exist, check the *decoded* content (shapes,
label range, image/label counts) rather than archive checksums, and fail with one sentence that
names what is wrong and how to fix it.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import os
import struct
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedskew.streams import numpy_rng


class DatasetError(ValueError):
    """A dataset is missing, corrupt or asked for with impossible parameters."""


@dataclass(frozen=True)
class Dataset:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    # The natural client (LEAF writer or role) of each training sample, for partition=natural.
    train_groups: torch.Tensor | None = None
    group_names: tuple[str, ...] | None = None
    # A global validation set held out of the training split (dataset.validation_fraction).
    x_val: torch.Tensor | None = None
    y_val: torch.Tensor | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def describe(self) -> str:
        return (f"{self.name}: {len(self.y_train)} train / {len(self.y_test)} test samples, "
                f"{self.num_classes} classes, input {self.input_shape}")


def _stratified_split(y: np.ndarray, test_fraction: float, rng: np.random.Generator):
    """Per class, shuffle and hold out round(test_fraction * n_c) samples (at least 1)."""
    train, test = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_test = max(1, int(round(test_fraction * len(idx))))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _digits_table() -> np.ndarray:
    """scikit-learn's bundled ``digits.csv.gz`` (1,797 rows: 64 pixels, then the label), read the way
    :func:`sklearn.datasets.load_digits` reads it (``np.loadtxt``, comma-separated) but without importing
    scikit-learn: its import brings SciPy and pandas, 1.4 s of CPU in every process that loads digits
    (measured beside importing torch, 1.4 s), where reading the file takes milliseconds. tests/test_data.py
    checks the arrays equal scikit-learn's loader's. A scikit-learn that keeps the file elsewhere is read
    through its loader."""
    spec = importlib.util.find_spec("sklearn")  # (finds the package without running it)
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits as sk_digits

        bunch = sk_digits()
        return np.column_stack([bunch.data, bunch.target])
    with gzip.open(path, "rt") as fh:
        return np.loadtxt(fh, delimiter=",")


def load_digits(seed: int, test_fraction: float = 0.2) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1,797 samples), the offline default.

    There is no official split, so the test set is a stratified ``test_fraction`` of every class,
    drawn with the experiment seed's ``dataset`` stream; pixel values 0..16 are scaled to [0, 1].
    """
    table = _digits_table()
    x = table[:, :-1].reshape(-1, 8, 8).astype(np.float32) / 16.0
    y = table[:, -1].astype(np.int64)
    tr, te = _stratified_split(y, test_fraction, numpy_rng(seed, "dataset"))
    xt = torch.from_numpy(x).unsqueeze(1)
    yt = torch.from_numpy(y)
    return Dataset("digits", xt[tr], yt[tr], xt[te], yt[te], 10)


def make_synthetic(seed: int, num_classes: int = 10, dim: int = 60, train_per_class: int = 200,
                   test_per_class: int = 50, separation: float = 3.0) -> Dataset:
    """Gaussian class clusters (LEAF "synthetic" style, without the client-specific models).

    Class means ~ N(0, separation^2 / dim * I), so two means lie about ``separation * sqrt(2)``
    apart; samples are unit isotropic Gaussians around them. Everything is drawn from the seed's
    ``dataset`` stream. Inputs have shape ``[dim]`` (use the ``mlp`` model).
    """

    rng = numpy_rng(seed, "dataset")
    means = rng.normal(0.0, separation / np.sqrt(dim), size=(num_classes, dim))

    def draw(per_class):
        y = np.repeat(np.arange(num_classes), per_class)
        x = means[y] + rng.normal(size=(len(y), dim))
        return torch.tensor(x, dtype=torch.float32), torch.from_numpy(y.astype(np.int64))

    xtr, ytr = draw(train_per_class)
    xte, yte = draw(test_per_class)
    return Dataset("synthetic", xtr, ytr, xte, yte, num_classes)


# ---------------------------------------------------------------------------------------------
# IDX (MNIST / Fashion-MNIST)

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


MAX_IDX_BYTES = 8 << 30  # no real IDX data set is larger


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed) and check that its length matches its header."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as fh:
            head = fh.read(4)
            if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] not in _IDX_DTYPES:
                raise DatasetError(f"IDX file {path} has no valid IDX header; it is not an IDX file or it is corrupt.")
            dtype, ndim = np.dtype(_IDX_DTYPES[head[2]]), head[3]
            dims = fh.read(4 * ndim)
            if len(dims) < 4 * ndim:
                raise DatasetError(f"IDX file {path} is truncated inside its header.")
            shape = struct.unpack(">" + "I" * ndim, dims)
            size = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
            # Bound what the header may ask for before reading it: gzip inflates real data sets about 4x
            # (at most about 1000x), so a declared size far beyond the file's is a decompression bomb.
            limit = min(MAX_IDX_BYTES, (1100 if path.suffix == ".gz" else 1) * path.stat().st_size + 1024)
            if size > limit:
                raise DatasetError(f"IDX file {path} declares shape {shape} ({size:,} bytes), more than a "
                                   f"{path.stat().st_size:,}-byte file can hold; it is corrupt or hostile.")
            body = fh.read(size + 1)
    except (OSError, EOFError) as exc:
        raise DatasetError(f"IDX file {path} could not be read ({exc}); delete it and fetch it again.") from exc
    header = 4 + 4 * ndim
    raw = head + dims + body
    expected = header + size
    if len(raw) != expected:
        raise DatasetError(f"IDX file {path} holds {len(raw)} bytes but its header {shape} needs "
                           f"{expected}; the file is truncated or corrupt.")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


_IDX_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
              "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}

_MIRRORS = {
    "mnist": ["https://ossci-datasets.s3.amazonaws.com/mnist/"],
    "fmnist": ["http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"],
}
# (mean, std) of the training pixels scaled to [0, 1]; the usual torchvision normalisation.
_IDX_NORMALISATION = {"mnist": (0.1307, 0.3081), "fmnist": (0.2860, 0.3530)}


def search_folders(name: str, root: str | None, subs: list[str]) -> list[Path]:
    """Folders searched for a data set's files, in order: ``root``, ``root/<sub>``,
    ``$FEDSKEW_DATA/<sub>``, ``~/.cache/fedskew/<name>`` and its subs (``subs``: the folder names
    the data set's archives and other tools use)."""
    folders = []
    if root:
        folders += [Path(root)] + [Path(root) / sub for sub in subs]
    if os.environ.get("FEDSKEW_DATA"):
        folders += [Path(os.environ["FEDSKEW_DATA"]) / sub for sub in subs]
    cache = Path.home() / ".cache" / "fedskew" / name
    return folders + [cache] + [cache / sub for sub in subs]


def idx_search_folders(name: str, root: str | None) -> list[Path]:
    """Folders searched for a data set's IDX files, in order (Fashion-MNIST: also Debian's)."""
    # Sub-folder names used by fedskew, by Debian/other mirrors and by torchvision's layout.
    subs = {"mnist": ["mnist", "MNIST/raw"], "fmnist": ["fmnist", "fashion-mnist", "FashionMNIST/raw"]}[name]
    folders = search_folders(name, root, subs)
    if name == "fmnist":
        folders.append(Path("/usr/share/datasets/fashion-mnist"))
    return folders


def _find(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / stem, folder / (stem + ".gz")):
        if candidate.is_file():
            return candidate
    return None


def _download(name: str, folder: Path, timeout: float) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    for mirror in _MIRRORS[name]:
        try:
            for stems in _IDX_FILES.values():
                for stem in stems:
                    target = folder / (stem + ".gz")
                    if target.exists():
                        continue
                    tmp = target.with_suffix(".gz.part")
                    with urllib.request.urlopen(mirror + stem + ".gz", timeout=timeout) as resp:
                        tmp.write_bytes(resp.read())
                    tmp.replace(target)
            return True
        except OSError:
            continue
    return False


def load_idx_dataset(name: str, root: str | None = None, download: bool = True, *,
                     timeout: float = 20.0) -> Dataset:
    """MNIST (``mnist``) or Fashion-MNIST (``fmnist``) from IDX files.

    Searched in order: ``root`` and its sub-folders ``<name>``, ``fashion-mnist`` (fmnist) and
    torchvision's ``MNIST/raw`` / ``FashionMNIST/raw``, the same under ``$FEDSKEW_DATA``,
    ``~/.cache/fedskew/<name>`` and, for Fashion-MNIST, Debian's ``/usr/share/datasets/fashion-mnist``.
    Only when no folder holds all four files and ``download`` is set does it try the usual
    mirrors, into ``root`` (or the cache folder).
    """
    if name not in _MIRRORS:
        raise DatasetError(f"dataset.name '{name}' has no IDX loader; allowed: {sorted(_MIRRORS)}.")
    folders = idx_search_folders(name, root)

    def locate():
        for folder in folders:
            found = {split: [_find(folder, s) for s in stems] for split, stems in _IDX_FILES.items()}
            if all(p is not None for ps in found.values() for p in ps):
                return found
        return None

    found = locate()
    if found is None and download:
        target = Path(root) if root else Path.home() / ".cache" / "fedskew" / name
        if _download(name, target, timeout):
            found = locate()
    if found is None:
        searched = ", ".join(str(f) for f in folders)
        hint = " or `apt-get install dataset-fashion-mnist`" if name == "fmnist" else ""
        raise DatasetError(f"dataset '{name}' was not found in {searched}; put the four "
                           f"*-ubyte(.gz) files in one of them (set dataset.root){hint}.")

    mean, std = _IDX_NORMALISATION[name]
    arrays = {}
    for split, (img_path, lbl_path) in found.items():
        images, labels = read_idx(img_path), read_idx(lbl_path)
        if images.ndim != 3 or images.shape[1:] != (28, 28):
            raise DatasetError(f"{img_path} holds images of shape {images.shape[1:]}, expected (28, 28).")
        if labels.ndim != 1 or len(labels) != len(images):
            raise DatasetError(f"{lbl_path} holds {len(labels)} labels for {len(images)} images in {img_path}.")
        if len(labels) and (labels.min() < 0 or labels.max() > 9):
            raise DatasetError(f"{lbl_path} holds labels outside 0..9 (min {labels.min()}, max {labels.max()}).")
        x = (torch.from_numpy(images.astype(np.float32) / 255.0) - mean) / std
        arrays[split] = (x.unsqueeze(1), torch.from_numpy(labels.astype(np.int64)))
    return Dataset(name, *arrays["train"], *arrays["test"], 10)


def subsample(data: Dataset, train_fraction: float, test_fraction: float, seed: int) -> Dataset:
    """Keep a stratified share of every class of the training set (stream ``subsample``) and of
    the global test set (stream ``subsample_test``). For CPU-scale experiments on the large data
    sets; 1.0 keeps a split untouched."""

    def keep(y: torch.Tensor, fraction: float, stream: str) -> torch.Tensor | None:
        if fraction >= 1.0:
            return None
        y = y.numpy()
        rng = numpy_rng(seed, stream)
        return torch.from_numpy(np.sort(np.concatenate([
            rng.permutation(np.flatnonzero(y == c))[:max(1, int(round(fraction * (y == c).sum())))]
            for c in np.unique(y)])))

    tr, te = keep(data.y_train, train_fraction, "subsample"), keep(data.y_test, test_fraction, "subsample_test")
    x_train, y_train = (data.x_train, data.y_train) if tr is None else (data.x_train[tr], data.y_train[tr])
    x_test, y_test = (data.x_test, data.y_test) if te is None else (data.x_test[te], data.y_test[te])
    groups = data.train_groups if tr is None or data.train_groups is None else data.train_groups[tr]
    return Dataset(data.name, x_train, y_train, x_test, y_test, data.num_classes, groups, data.group_names)


def hold_out_validation(data: Dataset, fraction: float, seed: int) -> Dataset:
    """Move a stratified ``fraction`` of every class of the training set (at least one sample,
    stream ``validation``) into ``x_val``/``y_val``; clients are then partitioned from the rest."""

    train, val = _stratified_split(data.y_train.numpy(), fraction, numpy_rng(seed, "validation"))
    train, val = torch.from_numpy(train), torch.from_numpy(val)
    groups = data.train_groups[train] if data.train_groups is not None else None
    return Dataset(data.name, data.x_train[train], data.y_train[train], data.x_test, data.y_test, data.num_classes,
                   groups, data.group_names, data.x_train[val], data.y_train[val])
