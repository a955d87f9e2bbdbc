import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import write_idx
from fedskew.data.datasets import DatasetError, load_digits, load_idx_dataset, read_idx


def test_idx_fixture_loads_with_checked_shapes(idx_folder):
    ds = load_idx_dataset("mnist", str(idx_folder), download=False)
    assert ds.x_train.shape == (120, 1, 28, 28) and ds.x_test.shape == (40, 1, 28, 28)
    assert ds.y_train.dtype == torch.int64 and ds.y_train.tolist()[:12] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    raw = read_idx(idx_folder / "train-images-idx3-ubyte.gz")
    expected = (raw[0].astype(np.float32) / 255 - 0.1307) / 0.3081
    assert np.allclose(ds.x_train[0, 0].numpy(), expected, atol=1e-6)


def test_idx_plain_uncompressed_files(tmp_path):
    write_idx(tmp_path / "a-idx1-ubyte", np.arange(5), gz=False)
    assert read_idx(tmp_path / "a-idx1-ubyte").tolist() == [0, 1, 2, 3, 4]


def test_truncated_idx_is_rejected_clearly(idx_folder):
    write_idx(idx_folder / "train-images-idx3-ubyte.gz", np.zeros((120, 28, 28)), truncate=100)
    with pytest.raises(DatasetError, match="truncated or corrupt"):
        load_idx_dataset("mnist", str(idx_folder), download=False)


def test_not_an_idx_file(tmp_path):
    (tmp_path / "x").write_bytes(b"hello world")
    with pytest.raises(DatasetError, match="no valid IDX header"):
        read_idx(tmp_path / "x")


def test_label_image_count_mismatch(idx_folder):
    write_idx(idx_folder / "t10k-labels-idx1-ubyte.gz", np.arange(39) % 10)
    with pytest.raises(DatasetError, match="39 labels for 40 images"):
        load_idx_dataset("mnist", str(idx_folder), download=False)


def test_label_out_of_range(idx_folder):
    write_idx(idx_folder / "t10k-labels-idx1-ubyte.gz", np.full(40, 12))
    with pytest.raises(DatasetError, match="outside 0..9"):
        load_idx_dataset("mnist", str(idx_folder), download=False)


def test_missing_dataset_names_the_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(DatasetError, match=f"was not found in {tmp_path / 'none'}"):
        load_idx_dataset("mnist", str(tmp_path / "none"), download=False)


def test_fmnist_found_in_subfolder_of_root(idx_folder, tmp_path):
    sub = tmp_path / "data" / "fmnist"
    sub.mkdir(parents=True)
    for f in idx_folder.glob("*.gz"):
        (sub / f.name).write_bytes(f.read_bytes())
    ds = load_idx_dataset("fmnist", str(tmp_path / "data"), download=False)
    assert ds.name == "fmnist" and len(ds.y_train) == 120


def test_digits_split_is_stratified_and_seeded():
    a, b, c = load_digits(0), load_digits(0), load_digits(1)
    assert len(a.y_train) + len(a.y_test) == 1797 and a.x_train.shape[1:] == (1, 8, 8)
    assert torch.equal(a.y_test, b.y_test) and torch.equal(a.x_test, b.x_test)
    assert not torch.equal(a.x_test, c.x_test)
    per_class = torch.bincount(a.y_test, minlength=10).float()
    assert per_class.min() >= 34 and per_class.max() <= 38  # 20% of ~180 per class
    assert 0.0 <= a.x_train.min() and a.x_train.max() <= 1.0


def test_digits_are_scikit_learn_s_digits_read_without_importing_it(monkeypatch):
    """The file read directly holds what scikit-learn's loader returns, bit for bit, and loading it
    imports neither scikit-learn nor SciPy (in a fresh process); without the file, the loader's
    arrays all the same."""
    from sklearn.datasets import load_digits as sk_digits

    import fedskew.data.datasets as datasets

    bunch = sk_digits()
    table = datasets._digits_table()
    assert np.array_equal(table[:, :-1].reshape(-1, 8, 8), bunch.images)
    assert np.array_equal(table[:, -1].astype(np.int64), bunch.target)
    code = ("import sys; from fedskew.data.datasets import load_digits; load_digits(0); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'sklearn', 'scipy', 'pandas'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name: None)
    assert np.array_equal(datasets._digits_table(), table)


def test_train_and_test_subsample_are_stratified_and_seeded():
    from fedskew.data.datasets import subsample

    full = load_digits(0)
    a, b = subsample(full, 0.25, 1.0, 0), subsample(full, 0.25, 1.0, 0)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.x_test, full.x_test)
    per_class = torch.bincount(a.y_train, minlength=10)
    expected = torch.round(0.25 * torch.bincount(full.y_train, minlength=10).double()).long()
    assert torch.equal(per_class, expected)
    t = subsample(full, 1.0, 0.5, 0)
    assert torch.equal(t.x_train, full.x_train)
    expected = torch.round(0.5 * torch.bincount(full.y_test, minlength=10).double()).long()
    assert torch.equal(torch.bincount(t.y_test, minlength=10), expected)
