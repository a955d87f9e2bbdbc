"""Built-in sweeps: the default comparison (``fedskew sweep`` with no file, README's main command)
and ``fedskew reproduce <paper> --scale smoke|lite|paper`` for each seed paper's main table.

Scales:

* ``paper``: the paper's data set, model, rounds and optimiser settings (methods.md "Paper
  setting" sections); needs the data set on disk (``--data``) and, realistically, a GPU.
* ``lite``: real Fashion-MNIST (``--data``) at CPU scale (``small`` before 0.2, still
  read with a warning), under an hour on 2 cores with 2 jobs.
* ``smoke``: the bundled digits, a few rounds, one seed: checks the whole pipeline (run in CI).
"""

from __future__ import annotations

import copy

from fedskew.config import ConfigError

# Every seed method at its defaults (docs/methods.md): FedMR mu1 = 0.01 (code-form intra loss),
# mu2 = 1e-4; MAP alpha = 0.9, KD lambda = 0.01, the authors' code schedule, a bias-free
# classifier; ETF+GMV with the fixed ETF head; FedKA beta = 0.001.
SEED_METHODS = ["fedavg", "fedmr", "map", "etf_gmv", "fedka"]


def default_comparison() -> dict:
    """FedAvg and the four seed methods on digits (P20C3: 20 clients of 3 classes, 10 per round),
    3 seeds, 30 rounds of E = 5 on an MLP 64-128-64: README's main command. Every method runs at
    its documented defaults."""
    return {"name": "digits: FedAvg vs FedMR, MAP, ETF+GMV, FedKA",
            "base": {"dataset": "digits", "partition": {"name": "pcdd", "num_clients": 20, "classes_per_client": 3},
                     "model": {"name": "mlp", "hidden": [128, 64]}, "rounds": 30, "clients_per_round": 10,
                     "executor": "vectorized"},
            "methods": copy.deepcopy(SEED_METHODS), "partitions": {"P20C3": {}}, "seeds": [0, 1, 2],
            "report": {"metric": "global/test_acc_mean_last10", "baseline": "fedavg"}}


# ---------------------------------------------------------------------------------------------
# The papers' main tables

FEDMR_METHODS = ["fedavg", "fedprox", "scaffold", "fednova", "moon", "feddyn", "feddc", "fedproc",
                 {"name": "fedmr", "options": {"mu1": [0.1, 0.01, 0.001], "mu2": 1.0e-4}}]
MAP_METHODS = ["fedavg", "fedprox", "scaffold", "fedrs", "fedphp", "map",
               "ditto", "fedrep", "fedbabu", "fedrod", "perfedavg", "fedlc",
               {"name": "pfedme", "config": {"momentum": 0.0}},
               {"name": "fedproto", "config": {"model.classifier_bias": True}},
               "fedmmd", "fednova",
               # MAP's FedAwS cells come from its authors' code (lxcnju/FedRepo): its form, at the first of the two
               # points it searched (a grid here would hold a validation split out of every run of the part)
               {"name": "fedaws", "options": {"form": "fedrepo", "margin": 0.8, "server_steps": 30, "server_lr": 0.1}},
               "moon", "feddyn", "flda", "dittors"]
ETF_METHODS = ["fedavg", {"name": "fedavg", "label": "fedavg-etf", "config": {"model.classifier": "etf"}},
               "etf_gmv",
               {"name": "scaffold", "label": "scaffold-etf", "config": {"model.classifier": "etf"}}]
FEDKA_METHODS = ["fedavg", "fedprox", "moon", "fedntd",
                 {"name": "fedka", "options": {"ka_beta": [0.1, 0.01, 0.001]}}]

PAPERS = {
    # FedMR (TMLR 2023) Table 1: PxCy partitions, ResNet-18, all clients every round.
    "fedmr": {
        "paper": {
            "base": {
                "dataset": "cifar10",
                "model": "resnet18",
                "clients_per_round": "all",
                "rounds": 100,
                "local_epochs": 10,
                "batch_size": 128,
                "lr": 0.01,
                "momentum": 0.9,
                "weight_decay": 1.0e-5,
                "final_personalization": False,
                "feature_stats": False,
            },
            "partitions": {
                "P5C2": {"name": "pcdd", "num_clients": 5, "classes_per_client": 2},
                "P10C2": {"name": "pcdd", "num_clients": 10, "classes_per_client": 2},
                "P10C5": {"name": "pcdd", "num_clients": 10, "classes_per_client": 5},
            },
            "seeds": [0, 1, 2],
            "methods": FEDMR_METHODS,
        },
        "lite": {
            "base": {
                "dataset": {"name": "fmnist", "train_subsample": 0.1, "test_subsample": 0.2},
                "model": "simplecnn",
                "clients_per_round": "all",
                "rounds": 30,
                "local_epochs": 2,
                "batch_size": 64,
                "lr": 0.01,
                "final_personalization": False,
            },
            "partitions": {
                "P5C2": {"name": "pcdd", "num_clients": 5, "classes_per_client": 2},
                "P10C2": {"name": "pcdd", "num_clients": 10, "classes_per_client": 2},
            },
            "seeds": [0, 1, 2],
            "methods": ["fedavg", "fedprox", "scaffold", "moon", "fedmr"],
        },
    },
    # MAP (2023) Tables I/II: random class counts, 100 clients, 20% per round, bias-free classifier.
    # mlpnet is the authors' MLPNet (784-1024-1024-128, lxcnju/MAP networks/basic_classify_nets.py),
    # the network their Table I numbers come from; the paper's text says two 512-unit layers
    # (model.hidden=[512, 512]).
    "map": {
        "paper": {
            "base": {
                "dataset": "fmnist",
                "model": "mlpnet",
                "partition": {"name": "random_classes", "num_clients": 100, "local_test_fraction": 0.2},
                "clients_per_round": 20,
                "rounds": 150,
                "local_epochs": 5,
                "batch_size": 64,
                "lr": 0.03,
                "momentum": 0.9,
                "weight_decay": 1.0e-5,
                "model.classifier_bias": False,
            },
            "partitions": {"random_classes": {}},
            "seeds": [0, 1, 2],
            "methods": MAP_METHODS,
        },
        "lite": {
            "base": {
                "dataset": {"name": "fmnist", "train_subsample": 0.2},
                "model": {"name": "mlp", "hidden": [200, 200], "classifier_bias": False},
                "partition": {"name": "random_classes", "num_clients": 100, "local_test_fraction": 0.2},
                "clients_per_round": 20,
                "rounds": 40,
                "local_epochs": 5,
                "batch_size": 64,
                "lr": 0.03,
                "executor": "vectorized",
            },
            "partitions": {"random_classes": {}},
            "seeds": [0, 1, 2],
            "methods": MAP_METHODS,
        },
    },
    # Neural-collapse FL: fixed simplex-ETF head + memory vectors, label_count splits, VGG11.
    # n samples per held class: what the most-held class can give every holder (a class has up to
    # 30 / 62 holders among 100 clients with 2 / 5 classes each; tests/test_sweep.py checks it).
    "etf": {
        "paper": {
            "base": {
                "dataset": "cifar10",
                "model": "vgg11",
                "clients_per_round": 10,
                "rounds": 1000,
                "local_epochs": 2,
                "batch_size": 64,
                "lr": 0.03,
                "momentum": 0.9,
                "weight_decay": 5.0e-4,
                "final_personalization": False,
            },
            "partitions": {
                "C10-100-2": {
                    "name": "label_count",
                    "num_clients": 100,
                    "classes_per_client": 2,
                    "samples_per_class": 125,
                },
                "C10-100-5": {
                    "name": "label_count",
                    "num_clients": 100,
                    "classes_per_client": 5,
                    "samples_per_class": 60,
                },
            },
            "seeds": [0, 1, 2],
            "methods": ETF_METHODS,
        },
        "lite": {
            "base": {
                "dataset": {"name": "fmnist", "train_subsample": 0.2},
                "model": {"name": "mlp", "hidden": [200, 200]},
                "clients_per_round": 10,
                "rounds": 60,
                "local_epochs": 2,
                "batch_size": 64,
                "lr": 0.03,
                "executor": "vectorized",
                "final_personalization": False,
            },
            "partitions": {
                "C10-50-2": {
                    "name": "label_count",
                    "num_clients": 50,
                    "classes_per_client": 2,
                    "samples_per_class": 50,
                },
                "C10-50-5": {
                    "name": "label_count",
                    "num_clients": 50,
                    "classes_per_client": 5,
                    "samples_per_class": 25,
                },
            },
            "seeds": [0, 1, 2],
            "methods": ETF_METHODS,
        },
    },
    # FedKA Table 2: Dirichlet 0.1 over 10 clients, all selected, t-CNN, forgetting by class role.
    "fedka": {
        "paper": {
            "base": {
                "dataset": "cifar10",
                "model": "tcnn",
                "clients_per_round": "all",
                "rounds": 100,
                "local_epochs": 10,
                "batch_size": 128,
                "lr": 0.01,
                "momentum": 0.9,
                "weight_decay": 1.0e-5,
                "forgetting_stats": True,
                "final_personalization": False,
            },
            "partitions": {"Dir0.1": {"name": "dirichlet", "num_clients": 10, "alpha": 0.1}},
            "seeds": [0, 1, 2],
            "methods": FEDKA_METHODS,
        },
        "lite": {
            "base": {
                "dataset": {"name": "fmnist", "train_subsample": 0.02, "test_subsample": 0.2},
                "model": "tcnn",
                "clients_per_round": "all",
                "rounds": 20,
                "local_epochs": 2,
                "batch_size": 128,
                "lr": 0.01,
                "forgetting_stats": True,
                "forgetting_test_samples": 1000,
                "final_personalization": False,
            },
            "partitions": {"Dir0.1": {"name": "dirichlet", "num_clients": 10, "alpha": 0.1}},
            "seeds": [0, 1, 2],
            "methods": ["fedavg", "fedntd", {"name": "fedka", "options": {"ka_beta": [0.01, 0.001]}}],
        },
    },
}
SCALES = ("smoke", "lite", "paper")


# The smoke scale checks the pipeline, not the methods (the registry-wide health test trains every
# one): where the lite preset runs a whole table's comparison, smoke runs these of its methods.
SMOKE_METHODS = {"map": ["fedavg", "fedrs", "fedphp", "map", "ditto", "fedrep"]}


def _smoke(name: str) -> dict:
    """The lite preset's methods (first grid value; :data:`SMOKE_METHODS` where named) and partition
    kinds on digits: 3 rounds, one seed, at most 10 clients, an MLP (keeping the preset's classifier
    options)."""
    small = copy.deepcopy(PAPERS[name]["lite"])
    keep = SMOKE_METHODS.get(name)
    methods = []
    for m in small["methods"]:
        if keep is not None and (m if isinstance(m, str) else m["name"]) not in keep:
            continue
        m = {"name": m} if isinstance(m, str) else m
        methods.append({**m, "options": {k: (v[:1] if isinstance(v, list) else v)
                                         for k, v in m.get("options", {}).items()}})
    partitions = {}
    for label, p in small["partitions"].items():
        p = {**p, "num_clients": min(p.get("num_clients", 10), 10)}
        if p.get("name") == "label_count":
            p["samples_per_class"] = 10
        partitions[label] = p
    base = dict(small["base"])
    model = base.get("model")
    base.update({"dataset": "digits", "model": {**(model if isinstance(model, dict) else {}), "name": "mlp",
                                                "hidden": [32, 16]},
                 "rounds": 3, "local_epochs": 1, "batch_size": 16})
    if base.get("clients_per_round", "all") != "all":
        base["clients_per_round"] = 5
    partition = base.get("partition")
    if isinstance(partition, dict) and "num_clients" in partition:
        base["partition"] = {**partition, "num_clients": 10}
    return {"base": base, "partitions": partitions, "seeds": [0], "methods": methods}


def reproduction(name: str, scale: str, data_root: str | None = None) -> dict:
    """The sweep spec of ``fedskew reproduce <name> --scale <scale>``."""
    if name not in PAPERS:
        raise ConfigError(f"reproduce: '{name}' is not a preset; allowed: {sorted(PAPERS)}.")
    if scale == "small":  # the name before 0.2; the bench calls this scale lite
        import warnings

        warnings.warn("fedskew reproduce --scale small is now called lite (as in fedskew bench); fedskew reads "
                      "small until 0.2.", FutureWarning, stacklevel=2)
        scale = "lite"
    if scale not in SCALES:
        raise ConfigError(f"reproduce --scale '{scale}' is not allowed; allowed: {list(SCALES)}.")
    preset = _smoke(name) if scale == "smoke" else copy.deepcopy(PAPERS[name][scale])
    base = preset["base"]
    if data_root and scale != "smoke":
        dataset = base.get("dataset")
        base["dataset"] = {**({"name": dataset} if isinstance(dataset, str) else dataset), "root": data_root}
    return {"name": f"{name} ({scale} scale)", "base": base, "methods": preset["methods"],
            "partitions": preset["partitions"], "seeds": preset["seeds"],
            "report": {"metric": "global/test_acc_mean_last10", "baseline": "fedavg"}}


__all__ = ["PAPERS", "SCALES", "default_comparison", "reproduction"]
