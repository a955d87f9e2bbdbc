import numpy as np
import pytest
import torch

from fedskew.algorithms import ClientReport, Method
from fedskew.algorithms.base import FedAvgOptions, as_model_part
from fedskew.config import ModelConfig, load_config
from fedskew.data import load_federation
from fedskew.engine.local import SequentialExecutor, federated_state
from fedskew.engine.protocol import LocalSettings, batch_schedule
from fedskew.models import build_model


def bn_states():
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="cnnbn", width=2), (1, 8, 8), 3)
    states = []
    for i in range(3):
        s = federated_state(model)
        states.append({k: v + float(i + 1) * torch.randn_like(v) for k, v in s.items()})
    return states


@pytest.mark.parametrize("weighting", ["samples", "batches", "uniform"])
def test_fedavg_equals_hand_weighted_mean_including_bn_buffers(weighting):
    states = bn_states()
    reports = [ClientReport(0, 10, 2), ClientReport(1, 30, 2), ClientReport(2, 60, 8)]
    w = {"samples": [0.1, 0.3, 0.6], "batches": [1 / 6, 1 / 6, 4 / 6], "uniform": [1 / 3] * 3}[weighting]
    method = Method(FedAvgOptions(weighting=weighting))
    new, _ = method.aggregate({}, states[0], [as_model_part(s) for s in states], reports)
    assert "backbone.1.running_mean" in new and "backbone.1.running_var" in new
    assert "backbone.1.num_batches_tracked" not in new  # integer counters stay local
    for k in states[0]:
        expected = w[0] * states[0][k] + w[1] * states[1][k] + w[2] * states[2][k]
        assert torch.allclose(new[k], expected, atol=1e-6), k


def test_batch_schedule_covers_each_epoch_once_with_short_last_batch():
    s = LocalSettings(epochs=3, batch_size=4, seed=5)
    batches = batch_schedule(s, round_idx=2, client_id=7, n=10)
    assert [len(b) for b in batches] == [4, 4, 2] * 3
    for e in range(3):
        assert sorted(np.concatenate(batches[3 * e:3 * e + 3]).tolist()) == list(range(10))
    assert all(np.array_equal(a, b) for a, b in zip(batches, batch_schedule(s, 2, 7, 10)))


def test_sequential_client_training_equals_a_bare_torch_loop():
    cfg = load_config(None, ["partition.num_clients=5", "clients_per_round=5", "model.hidden=[16]"])
    fed = load_federation(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, fed.data.input_shape, 10)
    start = federated_state(model)
    settings = LocalSettings(epochs=2, batch_size=8, momentum=0.9, weight_decay=1e-3, grad_clip=0.5, seed=3)
    ex = SequentialExecutor(model, fed, Method(), settings, torch.device("cpu"))
    res = ex.train_client(4, 2, as_model_part(start), {}, lr=0.05)

    # The same work written out by hand.
    ref = build_model(cfg.model, fed.data.input_shape, 10)
    ref.load_state_dict(start, strict=False)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    idx = fed.train_idx[2]
    for pos in batch_schedule(settings, 4, 2, len(idx)):
        rows = idx[torch.from_numpy(pos)]
        loss = torch.nn.functional.cross_entropy(ref(fed.data.x_train[rows]), fed.data.y_train[rows])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
    for k, _v in ref.state_dict().items():
        assert torch.allclose(as_model_part(federated_state(ref))["model." + k], res.upload["model." + k])
    assert res.report.num_samples == len(idx) and res.report.num_steps == 2 * -(-len(idx) // 8)
