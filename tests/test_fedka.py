"""FedNTD, FedKA and the forgetting degree (methods.md section 4)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedskew.algorithms.methods.fedka import anchor_indices, knowledge_anchor_loss
from fedskew.algorithms.methods.fedntd import not_true_logits, ntd_loss
from fedskew.config import load_config
from fedskew.engine.runner import Experiment
from fedskew.metrics import class_roles, forgetting_degree
from fedskew.streams import numpy_rng


def test_class_roles_on_a_hand_made_client():
    counts = torch.tensor([50, 0, 3, 20, 0])  # shares 0.685, 0, 0.041, 0.274, 0
    assert class_roles(counts, 0.1).tolist() == [2, 0, 1, 2, 0]
    assert class_roles(counts, 0.3).tolist() == [2, 0, 1, 1, 0]
    assert class_roles(counts, 0.2).tolist() == [2, 0, 1, 2, 0]  # default-like 1/C = 0.2


def test_anchor_set_one_per_missing_and_non_dominant_class_capped():
    roles = torch.tensor([2, 0, 1, 0, 1, 0, 2])
    y = np.array([0, 0, 2, 2, 4, 6, 4, 0])
    rng = numpy_rng(0, "t")
    anchors = anchor_indices(roles, y, None, 10, "random", rng)
    assert sorted(c for s, c in anchors if s == "public") == [1, 3, 5]
    local = [i for s, i in anchors if s == "local"]
    assert sorted(y[local].tolist()) == [2, 4]
    capped = anchor_indices(roles, y, None, 3, "random", numpy_rng(0, "t"))
    assert len(capped) == 3 and set(capped) <= set(anchor_indices(roles, y, None, 10, "random", numpy_rng(1, "t"))
                                                   + [("local", i) for i in range(8)])
    losses = np.array([0, 0, 0.5, 0.9, 0.1, 0, 0.3, 0])
    hard = [i for s, i in anchor_indices(roles, y, losses, 10, "hard", rng) if s == "local"]
    easy = [i for s, i in anchor_indices(roles, y, losses, 10, "proficient", rng) if s == "local"]
    assert hard == [3, 6] and easy == [2, 4]  # class 2: losses 0.5 (2), 0.9 (3); class 4: 0.1 (4), 0.3 (6)


def test_knowledge_anchor_loss_by_hand_and_ignores_dominant_logits():
    g = torch.tensor([[1.0, 2.0, 3.0], [0.0, 1.0, 0.0], [9.0, 9.0, 9.0]])
    local = torch.tensor([[0.0, 2.0, 5.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    keep = torch.tensor([1.0, 0.0, 1.0])  # class 1 dominant
    valid = torch.tensor([1.0, 1.0, 0.0])  # third row is padding
    # anchor 1: (1-0)^2 + (3-5)^2 = 5; anchor 2: (0-1)^2 + (0-1)^2 = 2; mean over 2 anchors
    assert knowledge_anchor_loss(local, g, keep, valid).item() == pytest.approx(3.5)
    changed = local.clone()
    changed[:, 1] += 100.0
    assert knowledge_anchor_loss(changed, g, keep, valid).item() == pytest.approx(3.5)
    assert knowledge_anchor_loss(g, g, keep, valid).item() == 0.0
    assert knowledge_anchor_loss(local, g, keep, torch.zeros(3)).item() == 0.0  # empty anchor set


def test_ntd_removes_exactly_the_true_class_entry():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    y = torch.tensor([2, 0])
    assert not_true_logits(logits, y).tolist() == [[1.0, 2.0, 4.0], [6.0, 7.0, 8.0]]
    g = torch.tensor([[0.5, 0.0, -1.0, 1.0], [2.0, 0.0, 1.0, 0.0]])
    T = 2.0
    value = 0.0
    for row_l, row_g in zip(not_true_logits(logits, y), not_true_logits(g, y)):
        p, q = F.softmax(row_g / T, 0), F.softmax(row_l / T, 0)
        value += (p * (p / q).log()).sum().item()
    # the official code's form (default) has no T^2; the option adds it
    assert ntd_loss(logits, g, y, T).item() == pytest.approx(value / 2, rel=1e-5)
    assert ntd_loss(logits, g, y, T, tau_squared=True).item() == pytest.approx(value / 2 * T ** 2, rel=1e-5)
    moved = logits.clone()
    moved[0, 2] += 50.0
    moved[1, 0] -= 50.0  # the true-class logits do not enter
    assert ntd_loss(moved, g, y, T).item() == pytest.approx(ntd_loss(logits, g, y, T).item())


def test_forgetting_degree_by_hand():
    tau = forgetting_degree(torch.tensor([0.8, 0.5, 0.4]), torch.tensor([0.4, 0.5, 0.6]))
    assert tau.tolist() == pytest.approx([0.5, 0.0, -0.5])
    assert forgetting_degree(torch.tensor([1.0]), torch.tensor([0.0])).item() == pytest.approx(1.0)


def test_forgetting_stats_by_role_match_per_client_values(tmp_path):
    cfg = load_config(None, ["method=fedka", "partition=dirichlet", "partition.alpha=0.2", "partition.num_clients=6",
                             "clients_per_round=3", "rounds=2", "local_epochs=1", "forgetting_stats=true",
                             "final_personalization=false"])
    exp = Experiment(cfg, tmp_path)
    res = exp.run()
    rec = res.history[-1]
    assert sorted(rec["forgetting/per_client"]) == sorted(str(k) for k in rec["clients"])
    pooled = {0: [], 1: [], 2: []}
    for k, taus in rec["forgetting/per_client"].items():
        roles = class_roles(exp.info.class_counts[int(k)], 0.1)
        for c, t in enumerate(taus):
            if t is not None and rec["forgetting/global_class_acc"][c] > 0:  # else nothing to forget: left out
                pooled[int(roles[c])].append(t)
    for role, name in enumerate(("missing", "non_dominant", "dominant")):
        if pooled[role]:
            assert rec[f"forgetting/{name}"] == pytest.approx(sum(pooled[role]) / len(pooled[role]))
    assert "train/fedka/anchor" in rec
