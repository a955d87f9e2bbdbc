import numpy as np
import pytest
import torch

from fedskew.algorithms import build_method
from fedskew.algorithms.compose import Composite
from fedskew.algorithms.tensors import (
    aggregate_prototypes,
    class_feature_means,
    inter_class_margin,
    intra_class_loss,
    sharing_clients,
)
from fedskew.config import load_config
from fedskew.engine.runner import run
from fedskew.metrics import eig_var_top50

NAN = float("nan")


def test_lemma1_eigenvalue_deviation_equals_frobenius_minus_d():
    """FedMR Lemma 1: for a correlation matrix M (unit diagonal) with eigenvalues l_i,
    sum_i (l_i - mean l)^2 = ||M||_F^2 - d (mean l = trace/d = 1)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 6)) @ rng.normal(size=(6, 6))
    m = np.corrcoef(x.T)
    eig = np.linalg.eigvalsh(m)
    assert np.isclose(((eig - eig.mean()) ** 2).sum(), (m ** 2).sum() - 6, atol=1e-10)
    # and our standardisation gives that correlation matrix (up to eps)
    z = torch.tensor(x, dtype=torch.float64)
    loss = intra_class_loss(z, torch.zeros(40, dtype=torch.long), 1, "paper", eps=0.0)
    assert float(loss) == pytest.approx((m ** 2).sum(), rel=1e-10)


def hand_intra(z, y, form, eps=1e-8):
    """Loop-by-loop reference: classes with >= 2 samples, standardised with their own mean and
    unbiased std (sqrt(var + eps))."""
    terms, counts = [], []
    for c in sorted(set(y)):
        zc = z[np.array(y) == c]
        n = len(zc)
        if n < 2:
            continue
        zs = (zc - zc.mean(0)) / np.sqrt(zc.var(0, ddof=1) + eps)
        if form == "paper":
            terms.append(((zs.T @ zs / (n - 1)) ** 2).sum())
        else:
            g = zs.T @ zs
            d = g.shape[0]
            terms.append(((g ** 2).sum() - (np.diag(g) ** 2).sum()) / (d * (d - 1)))
        counts.append(n)
    if not terms:
        return 0.0
    return sum(terms) / len(terms) if form == "paper" else sum(terms) / sum(counts)


@pytest.mark.parametrize("form", ["paper", "code"])
def test_intra_forms_by_hand(form):
    z = np.array([[1.0, 2.0, 0.5], [0.0, 1.0, 1.5], [2.0, 0.5, 0.0], [3.0, 1.0, 2.0],
                  [1.0, 1.0, 1.0], [0.2, 0.4, 0.8], [5.0, 1.0, 0.0]])
    y = [0, 0, 0, 1, 2, 2, 3]  # class 0: 3 samples, class 2: 2, classes 1 and 3: single (skipped)
    got = intra_class_loss(torch.tensor(z), torch.tensor(y), 4, form)
    assert float(got) == pytest.approx(hand_intra(z, y, form), rel=1e-9)


def test_intra_all_single_sample_classes_is_an_exact_zero_tensor():
    z = torch.randn(3, 4, requires_grad=True)
    loss = intra_class_loss(z, torch.tensor([0, 1, 2]), 5)
    assert isinstance(loss, torch.Tensor) and loss.item() == 0.0
    loss.backward()
    assert torch.equal(z.grad, torch.zeros_like(z.grad))


def test_margin_zero_on_own_prototypes_and_hand_value_otherwise():
    protos = torch.tensor([[0.0, 0.0], [1.0, 0.0], [NAN, NAN]])  # class 2 has no prototype
    classes = torch.tensor([5.0, 3.0, 0.0])  # the client holds classes 0 and 1: |C_k| = 2
    z = protos[:2].clone().requires_grad_(True)
    zero = inter_class_margin(z, torch.tensor([0, 1]), protos, classes)
    assert zero.item() == 0.0
    zero.backward()
    assert torch.isfinite(z.grad).all()
    # z = (0.9, 0) of class 0 is closer to g_1: D = |z-g0| - |z-g1| = 0.9 - 0.1 = 0.8;
    # one observed class, one other class with a prototype; / (|C_k| (|C_k|-1)) = 2 -> 0.4
    val = inter_class_margin(torch.tensor([[0.9, 0.0]]), torch.tensor([0]), protos, classes)
    assert val.item() == pytest.approx(0.4)
    # two samples of class 0: the mean over them, (0.8 + 0) / 2, then / 2
    val2 = inter_class_margin(torch.tensor([[0.9, 0.0], [-1.0, 0.0]]), torch.tensor([0, 0]), protos, classes)
    assert val2.item() == pytest.approx(0.2)


def test_margin_all_vs_local_classes():
    protos = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.5, 0.0]])
    classes = torch.tensor([4.0, 4.0, 0.0])  # class 2 not held by the client
    z, y = torch.tensor([[0.45, 0.0]]), torch.tensor([0])
    # all: j=1 -> max(0.45-0.55, 0)=0; j=2 -> 0.45-0.05 = 0.4; sum 0.4 / 2
    assert inter_class_margin(z, y, protos, classes, "all").item() == pytest.approx(0.2)
    assert inter_class_margin(z, y, protos, classes, "local").item() == pytest.approx(0.0)


def test_no_prototypes_means_no_margin():
    protos = torch.full((3, 2), NAN)
    assert inter_class_margin(torch.randn(4, 2), torch.tensor([0, 1, 2, 0]), protos, torch.ones(3)).item() == 0.0


def test_prototype_aggregation_is_count_weighted_and_keeps_missing_classes():
    prev = torch.tensor([[9.0, 9.0], [8.0, 8.0], [NAN, NAN]])
    m1, n1 = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]), torch.tensor([10.0, 0.0, 0.0])
    m2, n2 = torch.tensor([[4.0, 3.0], [0.0, 0.0], [0.0, 0.0]]), torch.tensor([30.0, 0.0, 0.0])
    g = aggregate_prototypes(prev, [m1, m2], [n1, n2])
    assert torch.allclose(g[0], torch.tensor([0.25 * 1 + 0.75 * 4, 0.75 * 3]))
    assert torch.equal(g[1], prev[1]) and torch.isnan(g[2]).all()


def test_class_feature_means():
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    means, counts = class_feature_means(z, torch.tensor([2, 0, 2]), 3)
    assert torch.equal(counts, torch.tensor([1.0, 0.0, 2.0]))
    assert torch.equal(means, torch.tensor([[3.0, 4.0], [0.0, 0.0], [3.0, 4.0]]))


def test_lite_uses_exactly_the_first_n_samples_of_the_batch():
    from fedskew.algorithms.base import Forward
    from fedskew.algorithms.components import PrototypeMargin, PrototypeOptions

    comp = PrototypeMargin(PrototypeOptions(mu2=1.0, lite_n=2))
    protos = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    z = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.9, 0.0], [0.8, 0.0]])  # the last two violate the margin
    y = torch.tensor([0, 1, 0, 0])
    fwd = Forward(lambda x: (x, x), None)
    state = {"proto.classes": torch.tensor([1.0, 1.0])}
    lite, _ = comp.loss(fwd, {}, z, y, {"proto.g": protos}, state)
    assert lite.item() == pytest.approx(inter_class_margin(z[:2], y[:2], protos, state["proto.classes"]).item())
    assert lite.item() == 0.0
    full, _ = PrototypeMargin(PrototypeOptions(mu2=1.0)).loss(fwd, {}, z, y, {"proto.g": protos}, state)
    assert full.item() > 0


def test_eig_var_top50_matches_numpy():
    rng = np.random.default_rng(1)
    z = rng.normal(size=(128, 60)) * np.linspace(0.1, 3, 60)
    eig = np.sort(np.linalg.eigvalsh(np.cov(z.T)))[::-1][:50]
    assert eig_var_top50(torch.tensor(z)) == pytest.approx(((eig - eig.mean()) ** 2).sum() / 128, rel=1e-9)


def test_partial_sharing_clients_are_fixed_by_the_seed():
    from fedskew.streams import numpy_rng

    a = sharing_clients(3, 10, 0.5)
    # an independent draw from the named stream (paper Table 5: round(fraction * K) clients)
    assert a == frozenset(int(k) for k in numpy_rng(3, "proto_share").choice(10, 5, replace=False))
    assert len(sharing_clients(3, 10, 0.3)) == 3 and sharing_clients(4, 10, 0.5) != a  # another seed, others
    assert sharing_clients(3, 10, 1.0) == frozenset(range(10))


SMALL = ["rounds=3", "partition.num_clients=6", "clients_per_round=4", "local_epochs=1", "batch_size=32",
         "model.hidden=[32,16]", "final_personalization=false"]


def test_fedmr_run_counts_prototypes_in_communication(tmp_path):
    res = run(load_config(None, SMALL + ["method=fedmr", "method.share_fraction=0.5"]), tmp_path)
    share = sharing_clients(0, 6, 0.5)
    c, d = 10, 16
    for h in res.history:
        assert h["comm/down_extra_floats"] == 4 * c * d  # prototypes down: C*d per client
        assert h["comm/up_extra_floats"] == sum(1 for k in h["clients"] if k in share) * (c * d + c)
    assert res.history[0]["train/fedmr/inter"] == 0.0  # round 0: no prototypes yet
    assert res.history[1]["train/fedmr/inter"] > 0.0
    assert "train/fedmr/intra" in res.history[0] and res.summary["comm/extra_pct"] > 0


def test_prototypes_compose_with_any_method_by_configuration():
    cfg = load_config(None, ["method=fedavg", "method.prototypes.mu2=0.001", "method.weighting=uniform"])
    method = build_method(cfg.method)
    assert isinstance(method, Composite) and method.components[0].opt.mu2 == 0.001
    assert method.base.opt.weighting == "uniform"
    from fedskew.config import ConfigError
    with pytest.raises(ConfigError, match="method.prototypes.mu3 is not an option of prototypes"):
        load_config(None, ["method.prototypes.mu3=1"])
    with pytest.raises(ConfigError, match="method.mu1 is not an option of fedavg"):
        load_config(None, ["method.mu1=1"])


def test_intra_loss_and_gradient_identical_under_vmap():
    from torch.func import vmap

    torch.manual_seed(0)
    z = torch.randn(3, 32, 20).relu()
    y = torch.randint(0, 4, (3, 32))
    z1, z2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    plain = torch.stack([intra_class_loss(z1[i], y[i], 4) for i in range(3)])
    (g1,) = torch.autograd.grad(plain.sum(), z1)
    batched = vmap(lambda a, b: intra_class_loss(a, b, 4))(z2, y)
    (g2,) = torch.autograd.grad(batched.sum(), z2)
    assert torch.allclose(plain, batched, rtol=1e-6) and torch.allclose(g1, g2, rtol=1e-5, atol=1e-6)
