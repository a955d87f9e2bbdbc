"""LEAF data sets (Caldas et al., 2018) in LEAF's JSON output: ``train/*.json`` and
``test/*.json`` (optionally gzipped), each ``{"users": [...], "num_samples": [...],
"user_data": {user: {"x": [...], "y": [...]}}}``.

* ``femnist``: 62 classes, x = 784 floats per image (LEAF's values, 1.0 = background), read as
  [1, 28, 28]; the natural client is the writer.
* ``shakespeare``: next-character prediction; x = an 80-character string, y = the next character,
  both encoded with LEAF's 80-character alphabet; the natural client is the speaking role.

Training samples carry their user (``Dataset.train_groups``) for the ``natural`` partition; the
global test set is every test file's samples (also of users with test data only). LEAF data must
be produced by LEAF's own preprocessing (``preprocess.sh``), so there is no download.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import torch

from fedskew.data.datasets import Dataset, DatasetError, search_folders

# LEAF's character set for Shakespeare (leaf/models/utils/language_utils.py: ALL_LETTERS).
ALPHABET = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
SEQ_LEN = 80


def read_leaf_file(path: Path) -> dict:
    """One LEAF JSON file, its structure checked."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as fh:
            blob = json.load(fh)
    except RecursionError:
        raise DatasetError(f"LEAF file {path} nests its JSON deeper than Python can read; LEAF output is at most a "
                           f"few levels deep, so it is not LEAF output.") from None
    except (OSError, EOFError, ValueError) as exc:
        raise DatasetError(f"LEAF file {path} could not be read ({(str(exc).splitlines() or [''])[0][:120]}); it is "
                           f"truncated or corrupt.") from None
    if not isinstance(blob, dict) or not {"users", "num_samples", "user_data"} <= set(blob):
        raise DatasetError(f"LEAF file {path} lacks the keys users, num_samples and user_data; it is not LEAF output.")
    kinds = {"users": list, "num_samples": list, "user_data": dict}
    for key, kind in kinds.items():
        if not isinstance(blob[key], kind):
            raise DatasetError(f"LEAF file {path}: {key} is a JSON {type(blob[key]).__name__}, but LEAF writes a "
                               f"{'list' if kind is list else 'mapping from user to samples'}; it is not LEAF output.")
    if not all(isinstance(u, str) for u in blob["users"]) or not all(
            isinstance(n, int) and n >= 0 for n in blob["num_samples"]):
        raise DatasetError(f"LEAF file {path}: users must be strings and num_samples non-negative integers; it is "
                           f"not LEAF output.")
    if len(blob["users"]) != len(blob["num_samples"]):
        raise DatasetError(f"LEAF file {path} lists {len(blob['users'])} users but {len(blob['num_samples'])} "
                           f"sample counts.")
    for user, n in zip(blob["users"], blob["num_samples"]):
        data = blob["user_data"].get(user)
        if not isinstance(data, dict) or not isinstance(data.get("x"), list) or not isinstance(data.get("y"), list) \
                or len(data["x"]) != n or len(data["y"]) != n:
            raise DatasetError(f"LEAF file {path}: user {user!r} should hold {n} samples in x and y, but its "
                               f"user_data does not.")
    return blob


def _leaf_files(folder: Path, split: str) -> list[Path]:
    return sorted(p for p in (folder / split).glob("*.json*") if p.suffix in (".json", ".gz"))


def _read_split(folder: Path, split: str, encode) -> tuple[list[str], list, list, list[int]]:
    """(users, per-user x arrays, per-user y arrays) of a split, users in file order."""
    users, xs, ys = [], [], []
    for path in _leaf_files(folder, split):
        blob = read_leaf_file(path)
        for user in blob["users"]:
            data = blob["user_data"][user]
            x, y = encode(data["x"], data["y"], path, user)
            users.append(user)
            xs.append(x)
            ys.append(y)
    return users, xs, ys


def _femnist_encode(x, y, path, user):
    try:
        x = np.asarray(x, dtype=np.float32)
        y_raw = np.asarray(y)
        if y_raw.ndim != 1 or (len(y_raw) and (y_raw.dtype.kind not in "iuf" or np.any(y_raw != np.round(y_raw)))):
            raise ValueError("labels must be integers")
        y = y_raw.astype(np.int64)
    except (ValueError, TypeError) as exc:  # ragged, nested, strings, fractional labels
        raise DatasetError(f"LEAF file {path}: user {user!r} has x or y that are not numbers of the expected "
                           f"shape ({str(exc).splitlines()[0][:100]}).") from None
    if x.ndim != 2 or x.shape[1] != 784:
        raise DatasetError(f"LEAF file {path}: user {user!r} has images of shape {x.shape[1:]}, expected 784 values.")
    if len(y) and (y.min() < 0 or y.max() > 61):
        raise DatasetError(f"LEAF file {path}: user {user!r} has labels outside 0..61.")
    return x.reshape(-1, 1, 28, 28), y


def _shakespeare_encode(x, y, path, user):
    table = {c: i for i, c in enumerate(ALPHABET)}
    try:
        xs = np.array([[table[c] for c in s] for s in x], dtype=np.int64).reshape(len(x), -1)
        ys = np.array([table[c] for c in y], dtype=np.int64)
    except KeyError as exc:
        raise DatasetError(f"LEAF file {path}: user {user!r} uses the character {str(exc.args[0])[:20]!r}, which is "
                           f"not in LEAF's 80-character alphabet.") from None
    except (ValueError, TypeError) as exc:  # ragged sequences, numbers or lists where strings belong
        raise DatasetError(f"LEAF file {path}: user {user!r} has x or y that are not strings of characters "
                           f"({str(exc).splitlines()[0][:100]}).") from None
    if len(x) and (xs.shape[1] != SEQ_LEN or any(len(c) != 1 for c in y)):
        raise DatasetError(f"LEAF file {path}: user {user!r} has sequences that are not {SEQ_LEN} characters "
                           f"followed by one next character.")
    return xs, ys


def load_leaf(name: str, root: str | None = None) -> Dataset:
    """FEMNIST or Shakespeare from a folder with LEAF's ``train`` and ``test`` sub-folders."""
    folders = search_folders(name, root, [name, f"{name}-leaf", f"{name}/data", "data"])
    folder = next((f for f in folders if _leaf_files(f, "train") and _leaf_files(f, "test")), None)
    if folder is None:
        raise DatasetError(f"dataset '{name}' was not found in {', '.join(str(f) for f in folders)}; put LEAF's "
                           f"train/ and test/ JSON folders (from LEAF's preprocess.sh) in one of them (set "
                           f"dataset.root).")
    encode, classes = (_femnist_encode, 62) if name == "femnist" else (_shakespeare_encode, len(ALPHABET))
    users, xs, ys = _read_split(folder, "train", encode)
    _, test_xs, test_ys = _read_split(folder, "test", encode)
    if not users or not sum(len(y) for y in ys):
        raise DatasetError(f"the LEAF train files in {folder / 'train'} hold no samples.")
    groups = np.concatenate([np.full(len(y), g, dtype=np.int64) for g, y in enumerate(ys)])
    return Dataset(name, torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys)),
                   torch.from_numpy(np.concatenate(test_xs)), torch.from_numpy(np.concatenate(test_ys)), classes,
                   train_groups=torch.from_numpy(groups), group_names=tuple(users))


__all__ = ["ALPHABET", "load_leaf", "read_leaf_file"]
