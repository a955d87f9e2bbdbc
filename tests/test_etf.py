"""Fixed simplex-ETF head and global memory vectors (methods.md section 3), label_count partition."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedskew.algorithms.methods.etf_gmv import aggregate_memory_vectors, memory_features
from fedskew.config import ConfigError, ModelConfig, PartitionConfig, load_config
from fedskew.data.partitions import PartitionError, partition_labels
from fedskew.engine.runner import Experiment, run
from fedskew.models import ModelError, build_model
from fedskew.models.nets import simplex_etf
from fedskew.streams import numpy_rng

SMALL = ["rounds=4", "partition.num_clients=6", "clients_per_round=3", "local_epochs=1", "batch_size=16",
         "model.classifier=etf", "final_personalization=false"]


@pytest.mark.parametrize("d,C", [(10, 10), (64, 10), (200, 62)])
def test_etf_columns_unit_norm_and_equiangular(d, C):
    m = simplex_etf(d, C, torch.Generator().manual_seed(3)).double()
    assert m.shape == (d, C)
    assert torch.allclose(m.norm(dim=0), torch.ones(C, dtype=torch.float64), atol=1e-6)
    cos = m.T @ m
    off = cos[~torch.eye(C, dtype=torch.bool)]
    assert torch.allclose(off, torch.full_like(off, -1 / (C - 1)), atol=1e-6)


def test_etf_needs_enough_feature_dimensions():
    with pytest.raises(ModelError, match="model.hidden's last width"):
        build_model(ModelConfig(hidden=[32, 8], classifier="etf"), (1, 8, 8), 10)
    with pytest.raises(ModelError, match="model.projection_dim to 10 or more"):
        build_model(ModelConfig(hidden=[32], projection_dim=4, classifier="etf"), (1, 8, 8), 10)


def test_same_seed_same_etf_whatever_the_global_rng():
    torch.manual_seed(1)
    a = build_model(ModelConfig(classifier="etf", etf_scale=1.5), (1, 8, 8), 10, seed=7)
    torch.manual_seed(2)
    b = build_model(ModelConfig(classifier="etf", etf_scale=1.5), (1, 8, 8), 10, seed=7)
    c = build_model(ModelConfig(classifier="etf", etf_scale=1.5), (1, 8, 8), 10, seed=8)
    assert torch.equal(a.classifier.weight, b.classifier.weight)
    assert not torch.equal(a.classifier.weight, c.classifier.weight)
    m = simplex_etf(200, 10, torch.Generator().manual_seed(0))
    assert a.classifier.weight.norm(dim=1) == pytest.approx(torch.full((10,), 1.5), abs=1e-5)  # beta * unit rows
    assert a.classifier.weight.shape == m.T.shape


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_etf_head_never_trained_never_sent_counted_once(tmp_path, executor):
    exp = Experiment(load_config(None, SMALL + [f"executor={executor}"]), tmp_path)
    before = exp.model.classifier.weight.clone()
    res = exp.run()
    assert torch.equal(exp.model.classifier.weight, before)            # bit-identical after training
    fresh = build_model(exp.cfg.model, exp.fed.data.input_shape, 10, seed=exp.cfg.seed)
    assert torch.equal(fresh.classifier.weight, before)                # what any client rebuilds
    assert "classifier.weight" not in res.global_state                 # never exchanged
    model_floats = sum(v.numel() for v in res.global_state.values())
    etf = before.numel()
    h = res.history
    assert h[0]["comm/down_floats"] == 3 * model_floats + etf          # once, at the start
    assert h[1]["comm/down_floats"] == 3 * model_floats
    assert h[0]["comm/down_extra_floats"] == 0


def test_etf_runs_under_other_methods_and_executors_agree(tmp_path):
    for extra in (["method=scaffold"], ["method=moon", "model.projection_dim=16"],
                  ["method=etf_gmv", "method.gmv_warmup_rounds=2", "method.gmv_alpha=1.0"]):
        a = run(load_config(None, SMALL + extra + ["executor=sequential"]), tmp_path / ("s" + extra[0]))
        b = run(load_config(None, SMALL + extra + ["executor=vectorized"]), tmp_path / ("v" + extra[0]))
        for k in a.global_state:
            assert torch.allclose(a.global_state[k], b.global_state[k], atol=1e-5), (extra, k)


def test_methods_that_need_a_certain_head_say_so(tmp_path):
    with pytest.raises(ConfigError, match="method 'fedaws' needs model.classifier = 'linear'"):
        Experiment(load_config(None, SMALL + ["method=fedaws"]), tmp_path / "a")
    with pytest.raises(ConfigError, match="method 'etf_gmv' needs model.classifier = 'etf'"):
        Experiment(load_config(None, SMALL + ["method=etf_gmv", "model.classifier=linear"]), tmp_path / "b")


def test_gmv_applied_from_the_warmup_round_only(tmp_path):
    """Uploads start the round before R_warm, vectors go down from R_warm on, and only then does
    training see h = z + alpha mu_y."""
    exp = Experiment(load_config(None, SMALL + ["method=etf_gmv", "method.gmv_warmup_rounds=2"]), tmp_path)
    res = exp.run()
    C, d = 10, exp.model.feature_dim
    up = [h["comm/up_extra_floats"] for h in res.history]
    down = [h["comm/down_extra_floats"] for h in res.history]
    assert up == [0, 3 * (C * d + C), 3 * (C * d + C), 3 * (C * d + C)]
    assert down == [3 * 1, 3 * 1, 3 * (1 + C * d), 3 * (1 + C * d)]   # the round counter, then + vectors

    method = exp.method
    server = method.server_init(res.global_state, exp.info)
    server["gmv.mu"] = torch.randn(C, d)
    server["gmv.t"] = torch.tensor(1.0)
    assert "gmv.mu" not in method.broadcast(res.global_state, server)
    server["gmv.t"] = torch.tensor(2.0)
    payload = method.broadcast(res.global_state, server)
    assert torch.equal(payload["gmv.mu"], server["gmv.mu"])

    # the loss with vectors, by hand: CE(ETF(z + alpha * mu_y))
    x, y = exp.fed.data.x_train[:8], exp.fed.data.y_train[:8]
    from fedskew.engine.local import load_state, module_forward
    load_state(exp.model, res.global_state)
    fwd = module_forward(exp.model)
    loss, _ = method.local_loss(fwd, None, x, y, payload, {})
    z = exp.model(x, return_features=True)[0]
    hand = F.cross_entropy((z + 0.5 * server["gmv.mu"][y]) @ exp.model.classifier.weight.T, y)
    assert loss.item() == pytest.approx(hand.item(), rel=1e-6)
    plain, _ = method.local_loss(
        fwd, None, x, y, method.broadcast(res.global_state, {**server, "gmv.t": torch.tensor(0.0)}), {}
    )
    assert plain.item() == pytest.approx(F.cross_entropy(exp.model(x), y).item(), rel=1e-6)


def test_memory_vector_aggregation_by_hand():
    old = torch.tensor([[1.0, 1.0], [2.0, 2.0], [float("nan"), float("nan")]])
    means = [torch.tensor([[0.0, 2.0], [0.0, 0.0], [0.0, 0.0]]), torch.tensor([[4.0, 0.0], [0.0, 0.0], [0.0, 0.0]])]
    counts = [torch.tensor([1.0, 0.0, 0.0]), torch.tensor([3.0, 0.0, 0.0])]
    weighted = aggregate_memory_vectors(old, means, counts, "count")
    assert weighted[0].tolist() == [3.0, 0.5]                     # (1*[0,2] + 3*[4,0]) / 4
    assert weighted[1].tolist() == [2.0, 2.0]                     # held by no selected client: kept
    assert torch.isnan(weighted[2]).all()                         # never held: still none
    assert aggregate_memory_vectors(old, means, counts, "clients")[0].tolist() == [2.0, 1.0]  # plain mean
    z, y = torch.zeros(2, 2), torch.tensor([0, 2])
    assert memory_features(z, y, weighted, 0.5).tolist() == [[1.5, 0.25], [0.0, 0.0]]


def test_label_count_partition_exact_counts_and_errors():
    labels = np.repeat(np.arange(10), 50)
    cfg = PartitionConfig(name="label_count", num_clients=20, classes_per_client=2, samples_per_class=5)
    parts = partition_labels(cfg, labels, 10, numpy_rng(0, "partition"))
    assert len(parts) == 20
    for p in parts:
        counts = np.bincount(labels[p], minlength=10)
        assert sorted(counts[counts > 0].tolist()) == [5, 5]
    allidx = np.concatenate(parts)
    assert len(allidx) == len(set(allidx.tolist()))               # no sample shared
    too_many = PartitionConfig(name="label_count", num_clients=20, classes_per_client=5, samples_per_class=10)
    with pytest.raises(PartitionError, match="partition.samples_per_class = 10"):
        partition_labels(too_many, labels, 10, numpy_rng(0, "partition"))
