"""Image data sets in their official on-disk formats (protocols.md, "Datasets"):

* ``cifar10``, ``cifar100``: python pickle batches (``cifar-10-batches-py``, ``cifar-100-python``),
  read with an unpickler that only admits plain containers and numpy arrays;
* ``svhn``: ``train_32x32.mat`` / ``test_32x32.mat`` (``X`` [32, 32, 3, N], ``y`` [N, 1], label
  10 meaning digit 0);
* ``cinic10``: image folders ``train/<class>/*.png`` and ``test/<class>/*.png`` (``valid`` unused);
* ``tinyimagenet``: ``tiny-imagenet-200`` with ``wnids.txt``, ``train/<wnid>/images/*.JPEG`` and
  ``val/images`` + ``val/val_annotations.txt`` (the labelled validation set is the test split).

Folders are searched as for MNIST (``dataset.root`` and its sub-folders, ``$FEDSKEW_DATA``,
``~/.cache/fedskew/<name>``); only when none holds the files and ``dataset.download`` is set are
the official archives fetched and unpacked into the first folder. Content checks: array shapes,
label ranges, image sizes, counts. Images are normalised with the usual per-channel statistics.
"""

from __future__ import annotations

import pickle
import tarfile
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import torch

from fedskew.data.datasets import Dataset, DatasetError, search_folders

_STATS = {  # per-channel (mean, std) of the training images scaled to [0, 1]
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
    "cinic10": ((0.4789, 0.4723, 0.4305), (0.2421, 0.2383, 0.2587)),
    "tinyimagenet": ((0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821)),
}
# Official archives; `download` fetches them when no folder holds the data.
URLS = {
    "cifar10": ["https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"],
    "cifar100": ["https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"],
    "svhn": ["http://ufldl.stanford.edu/housenumbers/train_32x32.mat",
             "http://ufldl.stanford.edu/housenumbers/test_32x32.mat"],
    "cinic10": ["https://datashare.ed.ac.uk/bitstream/handle/10283/3192/CINIC-10.tar.gz"],
    "tinyimagenet": ["http://cs231n.stanford.edu/tiny-imagenet-200.zip"],
}
_SUBFOLDERS = {"cifar10": ["cifar10", "cifar-10-batches-py"], "cifar100": ["cifar100", "cifar-100-python"],
               "svhn": ["svhn", "SVHN"], "cinic10": ["cinic10", "CINIC-10", "cinic-10"],
               "tinyimagenet": ["tinyimagenet", "tiny-imagenet-200"]}


def _normalise(images: np.ndarray, name: str) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float32 [N, 3, H, W], normalised (one float copy)."""
    mean, std = _STATS[name]
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(255.0)
    x.sub_(torch.tensor(mean).view(1, 3, 1, 1)).div_(torch.tensor(std).view(1, 3, 1, 1))
    return x.contiguous()


def _fetch_and_unpack(name: str, target: Path, timeout: float = 60.0) -> bool:
    """Download the official files into ``target`` and unpack archives; False when unreachable."""
    target.mkdir(parents=True, exist_ok=True)
    for url in URLS[name]:
        dest = target / url.rsplit("/", 1)[-1]
        if not dest.exists():
            try:
                tmp = dest.with_name(dest.name + ".part")
                with urllib.request.urlopen(url, timeout=timeout) as resp, open(tmp, "wb") as fh:
                    while chunk := resp.read(1 << 20):
                        fh.write(chunk)
                tmp.replace(dest)
            except OSError:
                return False
        if dest.name.endswith((".tar.gz", ".tgz")):
            with tarfile.open(dest) as tar:
                if hasattr(tarfile, "data_filter"):  # refuses absolute paths, links out, devices
                    tar.extractall(target, filter="data")
                else:  # Python before 3.10.12: check the member names ourselves
                    bad = [m.name for m in tar.getmembers() if m.name.startswith("/") or ".." in Path(m.name).parts]
                    if bad:
                        raise DatasetError(f"archive {dest} holds unsafe paths such as {bad[0]!r}; not unpacked.")
                    tar.extractall(target)
        elif dest.suffix == ".zip":
            with zipfile.ZipFile(dest) as z:
                z.extractall(target)
    return True


def _locate(name: str, root: str | None, download: bool, present) -> Path:
    """The first searched folder for which ``present(folder)`` holds; else download; else a clear error."""
    folders = search_folders(name, root, _SUBFOLDERS[name])
    for folder in folders:
        if present(folder):
            return folder
    if download:
        target = Path(root) if root else Path.home() / ".cache" / "fedskew" / name
        if _fetch_and_unpack(name, target):
            for folder in [target] + [target / s for s in _SUBFOLDERS[name]]:
                if present(folder):
                    return folder
    raise DatasetError(f"dataset '{name}' was not found in {', '.join(str(f) for f in folders)}; put the "
                       f"official files ({URLS[name][0].rsplit('/', 1)[-1]}, unpacked) in one of them "
                       f"(set dataset.root), or allow dataset.download on a machine with internet access.")


# ---------------------------------------------------------------------------------------------
# CIFAR


class _ArrayUnpickler(pickle.Unpickler):
    """Admits only what CIFAR batches hold: dicts, lists, bytes, numbers and numpy arrays.

    numpy pickles an array as ``_reconstruct(ndarray, (0,), b'b')`` and then fills it from the
    bytes in the file (``__setstate__`` checks their length). The array class is handed out as a
    token that cannot be called, and ``_reconstruct`` only with that empty shape, so a few bytes of
    pickle cannot ask numpy for gigabytes before the data is checked."""

    ALLOWED = {("numpy", "dtype"), ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
               ("_codecs", "encode")}
    RECONSTRUCT = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct")}
    NDARRAY = object()  # stands for numpy.ndarray inside the pickle

    def find_class(self, module, name):
        if (module, name) == ("numpy", "ndarray"):
            return self.NDARRAY
        if (module, name) in self.RECONSTRUCT:
            return self._reconstruct
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"the file refers to {module}.{name}, which a CIFAR batch never holds")
        return super().find_class(module, name)

    @classmethod
    def _reconstruct(cls, subtype, shape, dtype):
        if subtype is not cls.NDARRAY or shape != (0,):
            raise pickle.UnpicklingError(f"the file asks numpy for an array of shape {str(shape)[:40]} before its "
                                         f"data, which numpy's own pickles never do")
        return np.ndarray((0,), dtype=np.uint8)


def read_cifar_batch(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N, 32, 32, 3], labels int64 [N]) of one CIFAR python batch, checked."""
    try:
        with open(path, "rb") as fh:
            batch = _ArrayUnpickler(fh, encoding="bytes").load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError) as exc:
        raise DatasetError(f"CIFAR batch {path} could not be read ({str(exc).splitlines()[0][:120]}); it is "
                           f"truncated or corrupt: delete it and fetch the data again.") from None
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        raise DatasetError(f"CIFAR batch {path} lacks the keys b'data' and {label_key!r}; it is not a CIFAR "
                           f"python batch.")
    data, raw_labels = batch[b"data"], batch[label_key]
    # Check types before numpy touches them: a few KB of shared pickle references can describe a
    # nested list that np.asarray would expand to gigabytes.
    if not isinstance(data, np.ndarray):
        raise DatasetError(f"CIFAR batch {path}: b'data' is a {type(data).__name__}, not an array; the file is not "
                           f"a CIFAR python batch.")
    if isinstance(raw_labels, np.ndarray):
        ok = raw_labels.ndim == 1 and raw_labels.dtype.kind in "iu"
    else:
        ok = isinstance(raw_labels, list) and len(raw_labels) <= len(data) and \
            all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in raw_labels)
    if not ok:
        raise DatasetError(f"CIFAR batch {path}: {label_key!r} is not a list of integer labels.")
    labels = np.asarray(raw_labels, dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise DatasetError(f"CIFAR batch {path} holds data of shape {data.shape} and type {data.dtype}; "
                           f"expected uint8 [N, 3072].")
    if len(labels) != len(data):
        raise DatasetError(f"CIFAR batch {path} holds {len(labels)} labels for {len(data)} images.")
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels


def load_cifar(name: str, root: str | None = None, download: bool = True) -> Dataset:
    classes, label_key = (10, b"labels") if name == "cifar10" else (100, b"fine_labels")
    files = ({"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]} if name == "cifar10"
             else {"train": ["train"], "test": ["test"]})
    folder = _locate(name, root, download, lambda f: all((f / n).is_file() for ns in files.values() for n in ns))
    splits = {}
    for split, names in files.items():
        parts = [read_cifar_batch(folder / n, label_key) for n in names]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        if len(labels) and (labels.min() < 0 or labels.max() >= classes):
            raise DatasetError(f"{name} {split} labels lie outside 0..{classes - 1} "
                               f"(min {labels.min()}, max {labels.max()}) in {folder}.")
        splits[split] = (_normalise(images, name), torch.from_numpy(labels))
    return Dataset(name, *splits["train"], *splits["test"], classes)


# ---------------------------------------------------------------------------------------------
# SVHN


def load_svhn(root: str | None = None, download: bool = True) -> Dataset:
    from scipy.io import loadmat

    names = {"train": "train_32x32.mat", "test": "test_32x32.mat"}
    folder = _locate("svhn", root, download, lambda f: all((f / n).is_file() for n in names.values()))
    splits = {}
    for split, fname in names.items():
        path = folder / fname
        try:
            mat = loadmat(path)
        except Exception as exc:  # scipy raises several types for a damaged file
            raise DatasetError(f"SVHN file {path} could not be read ({str(exc).splitlines()[0][:120]}); it is "
                               f"truncated or corrupt: delete it and fetch it again.") from None
        if "X" not in mat or "y" not in mat:
            raise DatasetError(f"SVHN file {path} lacks the fields 'X' and 'y'; it is not an SVHN .mat file.")
        x, y = np.asarray(mat["X"]), np.asarray(mat["y"]).reshape(-1).astype(np.int64)
        if x.ndim != 4 or x.shape[:3] != (32, 32, 3) or x.shape[3] != len(y):
            raise DatasetError(f"SVHN file {path} holds X of shape {x.shape} for {len(y)} labels; expected "
                               f"[32, 32, 3, N].")
        if len(y) and (y.min() < 1 or y.max() > 10):
            raise DatasetError(f"SVHN file {path} holds labels outside 1..10 (min {y.min()}, max {y.max()}).")
        y[y == 10] = 0  # the official files label the digit 0 as 10
        splits[split] = (_normalise(np.ascontiguousarray(x.transpose(3, 0, 1, 2)).astype(np.uint8), "svhn"),
                         torch.from_numpy(y))
    return Dataset("svhn", *splits["train"], *splits["test"], 10)


# ---------------------------------------------------------------------------------------------
# Image folders


def _read_images(paths: list[Path], size: int, name: str) -> np.ndarray:
    """Decode images into one preallocated uint8 array [N, size, size, 3]."""
    from PIL import Image, UnidentifiedImageError

    out = np.empty((len(paths), size, size, 3), dtype=np.uint8)
    for i, path in enumerate(paths):
        try:
            with Image.open(path) as img:
                arr = np.asarray(img.convert("RGB"))
        except (OSError, UnidentifiedImageError) as exc:
            raise DatasetError(f"{name} image {path} could not be decoded ({str(exc)[:100]}); it is truncated or "
                               f"corrupt.") from None
        if arr.shape != (size, size, 3):
            raise DatasetError(f"{name} image {path} is {arr.shape[1]}x{arr.shape[0]}, expected {size}x{size}.")
        out[i] = arr
    return out


def load_cinic10(root: str | None = None, download: bool = True) -> Dataset:
    folder = _locate("cinic10", root, download, lambda f: (f / "train").is_dir() and (f / "test").is_dir())
    classes = sorted(p.name for p in (folder / "train").iterdir() if p.is_dir())
    if len(classes) != 10:
        raise DatasetError(f"CINIC-10 folder {folder / 'train'} holds {len(classes)} class folders, expected 10.")
    splits = {}
    for split in ("train", "test"):
        paths, labels = [], []
        for c, cls in enumerate(classes):
            if not (folder / split / cls).is_dir():
                raise DatasetError(f"CINIC-10 folder {folder / split} lacks the class folder '{cls}'.")
            files = sorted((folder / split / cls).glob("*.png"))
            paths += files
            labels += [c] * len(files)
        if not paths:
            raise DatasetError(f"CINIC-10 folder {folder / split} holds no .png images.")
        splits[split] = (_normalise(_read_images(paths, 32, "cinic10"), "cinic10"),
                         torch.tensor(labels, dtype=torch.int64))
    return Dataset("cinic10", *splits["train"], *splits["test"], 10)


def load_tinyimagenet(root: str | None = None, download: bool = True) -> Dataset:
    folder = _locate("tinyimagenet", root, download,
                     lambda f: (f / "wnids.txt").is_file() and (f / "train").is_dir() and (f / "val").is_dir())
    wnids = [w.strip() for w in (folder / "wnids.txt").read_text().split() if w.strip()]
    index = {w: i for i, w in enumerate(wnids)}
    paths, labels = [], []
    for w in wnids:
        files = sorted((folder / "train" / w / "images").glob("*.JPEG"))
        if not files:
            raise DatasetError(f"Tiny ImageNet folder {folder / 'train' / w / 'images'} holds no .JPEG images.")
        paths += files
        labels += [index[w]] * len(files)
    train = (_normalise(_read_images(paths, 64, "tinyimagenet"), "tinyimagenet"), torch.tensor(labels))
    annotations = folder / "val" / "val_annotations.txt"
    if not annotations.is_file():
        raise DatasetError(f"Tiny ImageNet lacks {annotations}, which labels the validation images.")
    paths, labels = [], []
    for line in annotations.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in index:
            raise DatasetError(f"{annotations} has a line that names no known class: {line[:80]!r}.")
        paths.append(folder / "val" / "images" / fields[0])
        labels.append(index[fields[1]])
    test = (_normalise(_read_images(paths, 64, "tinyimagenet"), "tinyimagenet"), torch.tensor(labels))
    return Dataset("tinyimagenet", *train, *test, len(wnids))


__all__ = ["URLS", "load_cifar", "load_cinic10", "load_svhn", "load_tinyimagenet", "read_cifar_batch"]
