"""The data, partition and model zoo of the papers (protocols.md): every loader reads a generated
fixture in its official on-disk format and rejects a corrupted one; models against their
published sizes; the shards and natural partitions; tensor augmentation."""

import gzip
import json
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import crash_after
from fedskew.config import ConfigError, ModelConfig, load_config
from fedskew.data import DatasetError, PartitionError, load_federation
from fedskew.data.augment import crop_flip, crop_flip_params
from fedskew.data.leaf import ALPHABET
from fedskew.data.partitions import natural, shards
from fedskew.engine.runner import run
from fedskew.models import ModelError, build_model
from fedskew.streams import numpy_rng

RNG = np.random.default_rng(0)


def fed_of(*items):
    return load_federation(load_config(None, ["clients_per_round=1", *items]))


# -- CIFAR -----------------------------------------------------------------------------------------


def write_cifar(folder, name="cifar10", per_batch=12):
    """The official python-pickle layout with the official keys."""
    classes, sub = (10, "cifar-10-batches-py") if name == "cifar10" else (100, "cifar-100-python")
    out = folder / sub
    out.mkdir(parents=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"] if name == "cifar10" else ["train", "test"]
    for n in names:
        labels = list(RNG.integers(0, classes, per_batch))
        key = b"labels" if name == "cifar10" else b"fine_labels"
        batch = {
            b"batch_label": n.encode(),
            key: labels,
            b"data": RNG.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"filenames": [f"{i}.png".encode() for i in range(per_batch)],
        }
        with open(out / n, "wb") as fh:
            pickle.dump(batch, fh, protocol=2)
    return out


@pytest.mark.parametrize("name,classes,train", [("cifar10", 10, 60), ("cifar100", 100, 12)])
def test_cifar_reads_the_official_pickle_batches(tmp_path, name, classes, train):
    out = write_cifar(tmp_path, name)
    fed = fed_of(f"dataset={name}", f"dataset.root={tmp_path}", "dataset.download=false", "partition=iid",
                 "partition.num_clients=3")
    d = fed.data
    assert d.input_shape == (3, 32, 32) and d.num_classes == classes and len(d.y_train) == train
    # pixel (row 0, col 1) of the first image: channel planes of 1024 values in the official layout
    raw = pickle.load(open(out / ("data_batch_1" if name == "cifar10" else "train"), "rb"), encoding="bytes")
    red = raw[b"data"][0, 1] / 255.0
    assert d.x_train[0, 0, 0, 1].item() == pytest.approx((red - 0.4914 if name == "cifar10" else red - 0.5071) /
                                                          (0.2470 if name == "cifar10" else 0.2673), abs=1e-5)


def test_a_dropout_model_trains_the_same_whatever_ran_before_and_after_a_resume(tmp_path):
    """VGG-11 (dropout 0.5 in its classifier) draws its masks from torch's global generator. A run
    must not depend on what that generator did before it (another run of the same sweep worker) or
    on a resume: the sequential executor seeds it per client, round and stage. Before that, the same
    config gave weights 0.02 apart after burning five random numbers first."""
    from fedskew.engine.resume import resume
    from fedskew.engine.runner import Experiment

    write_cifar(tmp_path, per_batch=8)
    cfg = load_config(None, ["dataset=cifar10", f"dataset.root={tmp_path}", "dataset.download=false", "model=vgg11",
                             "partition.num_clients=2", "clients_per_round=2", "partition.classes_per_client=5",
                             "rounds=2", "local_epochs=1", "batch_size=8", "final_personalization=false"])
    first = run(cfg, tmp_path / "a").global_state
    torch.rand(5)
    again = run(cfg, tmp_path / "b").global_state

    with pytest.raises(KeyboardInterrupt):
        Experiment(cfg, tmp_path / "cut").run(crash_after(0))
    torch.rand(7)
    resumed = resume(tmp_path / "cut").global_state
    for k in first:
        assert torch.equal(first[k], again[k]) and torch.equal(first[k], resumed[k]), k


def test_cifar_rejects_truncated_and_foreign_pickles(tmp_path):
    out = write_cifar(tmp_path)
    raw = (out / "data_batch_3").read_bytes()
    (out / "data_batch_3").write_bytes(raw[:len(raw) // 2])
    with pytest.raises(DatasetError, match="data_batch_3.*truncated or corrupt"):
        fed_of("dataset=cifar10", f"dataset.root={tmp_path}", "dataset.download=false")

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))  # harmless even if it ran
    with open(out / "data_batch_3", "wb") as fh:
        pickle.dump({b"data": Evil(), b"labels": []}, fh)
    with pytest.raises(DatasetError, match=r"refers to (posix|os)\.system, which a CIFAR batch never holds"):
        fed_of("dataset=cifar10", f"dataset.root={tmp_path}", "dataset.download=false")


def test_cifar_missing_names_the_folders_and_downloads_when_allowed(tmp_path, monkeypatch):
    with pytest.raises(DatasetError, match="cifar-10-python.tar.gz"):
        fed_of("dataset=cifar10", f"dataset.root={tmp_path / 'none'}", "dataset.download=false")
    # "online": the official archive served from a file:// URL is fetched and unpacked
    src = tmp_path / "src"
    write_cifar(src)
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    import fedskew.data.vision as V
    monkeypatch.setitem(V.URLS, "cifar10", [archive.as_uri()])
    fed = fed_of("dataset=cifar10", f"dataset.root={tmp_path / 'dl'}", "partition=iid", "partition.num_clients=2")
    assert len(fed.data.y_train) == 60 and (tmp_path / "dl" / "cifar-10-batches-py" / "test_batch").is_file()


# -- SVHN ------------------------------------------------------------------------------------------


def write_svhn(folder, n=20):
    from scipy.io import savemat

    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        y = (np.arange(n) % 10 + 1).reshape(-1, 1)  # 1..10, 10 = digit 0
        savemat(folder / f"{split}_32x32.mat", {"X": RNG.integers(0, 256, (32, 32, 3, n), dtype=np.uint8), "y": y})


def test_svhn_reads_the_mat_files_and_maps_10_to_0(tmp_path):
    write_svhn(tmp_path / "svhn")
    d = fed_of("dataset=svhn", f"dataset.root={tmp_path}", "dataset.download=false", "partition=iid",
               "partition.num_clients=2").data
    assert d.input_shape == (3, 32, 32) and sorted(d.y_train.unique().tolist()) == list(range(10))
    assert d.y_train[9].item() == 0  # label 10 in the file


def test_svhn_rejects_corrupt_and_incomplete_files(tmp_path):
    from scipy.io import savemat

    write_svhn(tmp_path)
    (tmp_path / "test_32x32.mat").write_bytes(b"MATLAB 5.0 MAT-file" + b"\x00" * 40)
    with pytest.raises(DatasetError, match="test_32x32.mat"):
        fed_of("dataset=svhn", f"dataset.root={tmp_path}", "dataset.download=false")
    savemat(tmp_path / "test_32x32.mat", {"X": np.zeros((32, 32, 3, 2), np.uint8)})
    with pytest.raises(DatasetError, match="lacks the fields 'X' and 'y'"):
        fed_of("dataset=svhn", f"dataset.root={tmp_path}", "dataset.download=false")


# -- LEAF ------------------------------------------------------------------------------------------


def write_leaf(folder, users, make, gz=True):
    """One LEAF JSON file per split: users -> sample counts (train) and a test file."""
    for split, counts in users.items():
        (folder / split).mkdir(parents=True, exist_ok=True)
        blob = {"users": list(counts), "num_samples": list(counts.values()),
                "user_data": {u: make(n) for u, n in counts.items()}}
        path = folder / split / f"all_data_0_{split}.json"
        if gz:
            with gzip.open(str(path) + ".gz", "wt") as fh:
                json.dump(blob, fh)
        else:
            path.write_text(json.dumps(blob))


def femnist_samples(n):
    return {"x": RNG.random((n, 784)).round(3).tolist(), "y": RNG.integers(0, 62, n).tolist()}


def test_femnist_natural_partition_gives_one_client_per_writer(tmp_path):
    write_leaf(tmp_path, {"train": {"f0001_01": 12, "f0002_02": 7, "f0003_03": 9},
                          "test": {"f0001_01": 3, "f0004_04": 2}}, femnist_samples)
    fed = fed_of("dataset=femnist", f"dataset.root={tmp_path}", "partition=natural", "partition.num_clients=3",
                 "partition.local_test_fraction=0.2")
    d = fed.data
    assert d.num_classes == 62 and d.input_shape == (1, 28, 28) and len(d.y_test) == 5
    assert d.group_names == ("f0001_01", "f0002_02", "f0003_03")
    sizes = [len(fed.train_idx[k]) + len(fed.test_idx[k]) for k in range(3)]
    assert sizes == [12, 7, 9]
    for k in range(3):  # every index of client k belongs to writer k
        assert (d.train_groups[torch.cat([fed.train_idx[k], fed.test_idx[k]])] == k).all()
    two = fed_of("dataset=femnist", f"dataset.root={tmp_path}", "partition=natural", "partition.num_clients=2")
    assert two.num_clients == 2
    with pytest.raises(PartitionError, match="partition.num_clients = 4 exceeds the 3 users"):
        fed_of("dataset=femnist", f"dataset.root={tmp_path}", "partition=natural", "partition.num_clients=4")


def test_leaf_rejects_inconsistent_and_corrupt_files(tmp_path):
    write_leaf(tmp_path, {"train": {"a": 4}, "test": {"a": 1}}, femnist_samples, gz=False)
    path = tmp_path / "train" / "all_data_0_train.json"
    blob = json.loads(path.read_text())
    blob["num_samples"] = [5]
    path.write_text(json.dumps(blob))
    with pytest.raises(DatasetError, match="user 'a' should hold 5 samples"):
        fed_of("dataset=femnist", f"dataset.root={tmp_path}")
    path.write_text(json.dumps(blob)[:50])
    with pytest.raises(DatasetError, match="truncated or corrupt"):
        fed_of("dataset=femnist", f"dataset.root={tmp_path}")
    with pytest.raises(DatasetError, match="LEAF's train/ and test/"):
        fed_of("dataset=femnist", f"dataset.root={tmp_path / 'nothing'}")


def test_natural_partition_needs_natural_clients():
    with pytest.raises(PartitionError, match="needs a data set with natural clients"):
        fed_of("partition=natural")


def shakespeare_samples(n):
    text = "".join(RNG.choice(list(ALPHABET), 81 + n))
    return {"x": [text[i:i + 80] for i in range(n)], "y": [text[i + 80] for i in range(n)]}


def test_shakespeare_next_character_with_the_lstm(tmp_path):
    write_leaf(tmp_path, {"train": {"ROMEO": 30, "JULIET": 20}, "test": {"ROMEO": 8}}, shakespeare_samples)
    res = run(load_config(None, ["dataset=shakespeare", f"dataset.root={tmp_path}", "partition=natural",
                                 "partition.num_clients=2", "clients_per_round=2", "model=lstm", "rounds=1",
                                 "local_epochs=1", "batch_size=10", "final_personalization=false"]), tmp_path / "run")
    assert res.summary["global/test_acc"] is not None
    d = load_federation(load_config(None, ["dataset=shakespeare", f"dataset.root={tmp_path}", "clients_per_round=1",
                                           "partition=natural", "partition.num_clients=2"])).data
    assert d.num_classes == 80 and d.x_train.shape[1:] == (80,) and d.x_train.dtype == torch.int64
    blob = json.load(gzip.open(tmp_path / "train" / "all_data_0_train.json.gz", "rt"))
    s = blob["user_data"]["ROMEO"]["x"][0]
    assert d.x_train[0].tolist() == [ALPHABET.index(c) for c in s]


def test_shakespeare_rejects_characters_outside_the_alphabet(tmp_path):
    write_leaf(tmp_path, {"train": {"A": 2}, "test": {"A": 1}},
               lambda n: {"x": ["\u00e9" * 80] * n, "y": ["a"] * n})
    with pytest.raises(DatasetError, match="not in LEAF's 80-character alphabet"):
        fed_of("dataset=shakespeare", f"dataset.root={tmp_path}")


# -- Image folders ---------------------------------------------------------------------------------


def write_images(paths, size):
    from PIL import Image

    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(RNG.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(p)


def test_cinic10_reads_class_folders_and_rejects_a_bad_image(tmp_path):
    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    root = tmp_path / "CINIC-10"
    write_images([root / s / c / f"{c}-{i}.png" for s in ("train", "test") for c in classes for i in range(2)], 32)
    d = fed_of("dataset=cinic10", f"dataset.root={tmp_path}", "dataset.download=false", "partition=iid",
               "partition.num_clients=2").data
    assert d.input_shape == (3, 32, 32) and len(d.y_train) == 20 and d.y_train.tolist() == sorted(d.y_train.tolist())
    (root / "test" / "cat" / "cat-0.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    with pytest.raises(DatasetError, match="cat-0.png could not be decoded"):
        fed_of("dataset=cinic10", f"dataset.root={tmp_path}", "dataset.download=false")


def test_tinyimagenet_uses_the_labelled_validation_set_as_test(tmp_path):
    root = tmp_path / "tiny-imagenet-200"
    wnids = ["n01443537", "n01629819"]
    (root / "val" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    write_images([root / "train" / w / "images" / f"{w}_{i}.JPEG" for w in wnids for i in range(3)], 64)
    write_images([root / "val" / "images" / f"val_{i}.JPEG" for i in range(4)], 64)
    (root / "val" / "val_annotations.txt").write_text(
        "".join(f"val_{i}.JPEG\t{wnids[i % 2]}\t0\t0\t63\t63\n" for i in range(4)))
    d = fed_of("dataset=tinyimagenet", f"dataset.root={tmp_path}", "dataset.download=false", "partition=iid",
               "partition.num_clients=2").data
    assert d.input_shape == (3, 64, 64) and d.num_classes == 2 and d.y_test.tolist() == [0, 1, 0, 1]
    write_images([root / "train" / wnids[0] / "images" / f"{wnids[0]}_0.JPEG"], 32)
    with pytest.raises(DatasetError, match="is 32x32, expected 64x64"):
        fed_of("dataset=tinyimagenet", f"dataset.root={tmp_path}", "dataset.download=false")


# -- Partitions ------------------------------------------------------------------------------------


def test_shards_gives_each_client_s_label_sorted_shards():
    labels = np.repeat(np.arange(10), 100)
    parts = shards(labels, 10, 2, numpy_rng(0, "partition"))
    assert sorted(np.concatenate(parts).tolist()) == list(range(1000))  # disjoint, complete
    for p in parts:
        assert len(p) == 100 and len(np.unique(labels[p])) <= 2  # shards of 50 hold one class each
    with pytest.raises(PartitionError, match="shards_per_client = 200"):
        shards(labels, 10, 200, numpy_rng(0, "partition"))


def test_natural_draws_users_from_the_seed():
    groups = np.repeat(np.arange(6), 5)
    a = natural(groups, 3, numpy_rng(0, "partition"))
    b = natural(groups, 3, numpy_rng(0, "partition"))
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert all(len(np.unique(groups[p])) == 1 for p in a)


# -- Models ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,shape,classes,features", [
    ("mlpnet", (1, 28, 28), 10, 128), ("tfcnn", (1, 28, 28), 10, 512), ("vgg8", (3, 32, 32), 10, 512),
    ("vgg8bn", (3, 32, 32), 10, 512), ("vgg11", (3, 32, 32), 10, 512), ("vgg16bn", (3, 32, 32), 100, 512),
    ("resnet18", (3, 32, 32), 10, 512), ("resnet20", (3, 32, 32), 10, 64), ("resnet56", (3, 32, 32), 10, 64),
    ("resnet18", (3, 64, 64), 200, 512), ("lstm", (80,), 80, 256),
])
def test_model_shapes_and_feature_dimension(name, shape, classes, features):
    model = build_model(ModelConfig(name=name), shape, classes)
    x = torch.randint(0, classes, (3, *shape)) if name == "lstm" else torch.randn(3, *shape)
    model.eval()
    z, logits = model(x, return_features=True)
    assert model.feature_dim == features and z.shape == (3, features) and logits.shape == (3, classes)


def test_parameter_counts_match_the_published_sizes():
    def count(name, shape=(3, 32, 32), classes=10):
        return sum(p.numel() for p in build_model(ModelConfig(name=name), shape, classes).parameters())
    assert count("resnet18") == 11_173_962  # CIFAR ResNet-18 (kuangliu/pytorch-cifar, FedMR's code)
    assert count("vgg11") == 9_750_922  # CIFAR-10 VGG-11 of FedNova / FedMA
    assert count("tfcnn", (1, 28, 28)) == 1_663_370  # McMahan et al. 2017: "1,663,370 total parameters"
    assert count("wrn28_10") == 36_479_194  # Zagoruyko & Komodakis: 36.5M


def test_models_refuse_inputs_they_cannot_read():
    with pytest.raises(ModelError, match="multiple of 32"):
        build_model(ModelConfig(name="vgg11"), (1, 28, 28), 10)
    with pytest.raises(ModelError, match="character sequences"):
        build_model(ModelConfig(name="lstm"), (1, 28, 28), 10)


def test_torchvision_models_need_torchvision():
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        with pytest.raises(ModelError, match="torchvision, which is not installed"):
            build_model(ModelConfig(name="resnet50"), (3, 32, 32), 10)
    else:
        model = build_model(ModelConfig(name="resnet50"), (3, 32, 32), 10)
        assert model.feature_dim == 2048


# -- Augmentation ----------------------------------------------------------------------------------


def test_crop_flip_by_hand():
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    out = crop_flip(x, torch.tensor([[4, 4, 0], [1, 7, 1]]), pad=4)
    assert torch.equal(out[0], x[0])  # centre offset, no flip: unchanged
    padded = F.pad(x[1], (4, 4, 4, 4))
    assert torch.equal(out[1], padded[:, 1:5, 7:12].flip(-1))
    params = crop_flip_params(0, 3, 2, 0, 1000)
    assert params[:, :2].min() == 0 and params[:, :2].max() == 8 and 0.4 < params[:, 2].float().mean() < 0.6
    assert torch.equal(params, crop_flip_params(0, 3, 2, 0, 1000))


def test_augmentation_changes_training_and_needs_images(tmp_path):
    base = ["model=cnnbn", "model.width=4", "rounds=1", "final_personalization=false", "partition.num_clients=4",
            "clients_per_round=2"]
    plain = run(load_config(None, base), tmp_path / "plain")
    aug = run(load_config(None, base + ["dataset.augment=true"]), tmp_path / "aug")
    assert not torch.equal(plain.global_state["classifier.weight"], aug.global_state["classifier.weight"])
    with pytest.raises(ConfigError, match="dataset.augment = true needs images"):
        run(load_config(None, ["dataset=synthetic", "dataset.augment=true"]))
