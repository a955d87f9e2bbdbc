import numpy as np
import pytest

from fedskew.data import partitions as P
from fedskew.data.partitions import PartitionError


def labels(n_per_class=50, classes=10):
    return np.repeat(np.arange(classes), n_per_class)


def rng(seed=0):
    return np.random.default_rng(seed)


def check_exact_cover(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == n and len(np.unique(allidx)) == n  # every sample once, no duplicates


def classes_of(parts, y):
    return [sorted(set(y[p].tolist())) for p in parts]


def test_pcdd_class_assignment_by_hand():
    # P4C3 on 10 classes: dealt in order 0..9, then the last two slots of client 3 are random.
    cls = P.pcdd_classes(4, 3, 10, rng())
    assert cls[:3] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert 9 in cls[3] and len(set(cls[3])) == 3


@pytest.mark.parametrize("x,y", [(10, 2), (20, 3), (7, 5), (50, 3)])
def test_pcdd_each_client_exactly_y_classes_and_all_covered(x, y):
    lab = labels()
    parts = P.pcdd(lab, x, y, 10, rng())
    check_exact_cover(parts, len(lab))
    held = classes_of(parts, lab)
    assert all(len(h) == y for h in held)
    assert set().union(*map(set, held)) == set(range(10))
    # each class split in near-equal parts among its holders
    for c in range(10):
        sizes = [int((lab[p] == c).sum()) for p in parts if (lab[p] == c).any()]
        assert max(sizes) - min(sizes) <= 1


def test_pcdd_same_seed_same_indices_and_seed_matters():
    lab = labels()
    a = P.pcdd(lab, 20, 3, 10, rng(1))
    b = P.pcdd(lab, 20, 3, 10, rng(1))
    c = P.pcdd(lab, 20, 3, 10, rng(2))
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert not all(np.array_equal(p, q) for p, q in zip(a, c))


def test_pcdd_impossible_requests_are_one_sentence_errors():
    lab = labels()
    with pytest.raises(PartitionError, match="classes_per_client = 11"):
        P.pcdd(lab, 20, 11, 10, rng())
    with pytest.raises(PartitionError, match="fewer than the 10 classes"):
        P.pcdd(lab, 3, 3, 10, rng())
    with pytest.raises(PartitionError, match="num_clients = 1000 exceeds"):
        P.pcdd(lab, 1000, 3, 10, rng())


@pytest.mark.parametrize("k", [1, 2, 4])
def test_label_k_holds_i_mod_c_and_k_classes(k):
    lab = labels()
    parts = P.label_k(lab, 30, k, 10, rng())
    check_exact_cover(parts, len(lab))
    for i, h in enumerate(classes_of(parts, lab)):
        assert len(h) == k and (i % 10) in h


def test_label_k_uncovered_class_is_a_clear_error():
    with pytest.raises(PartitionError, match="no holder"):
        P.label_k(labels(), 3, 1, 10, rng())


@pytest.mark.parametrize("alpha", [0.1, 0.5, 5.0])
def test_dirichlet_respects_min_size(alpha):
    lab = labels(100)
    parts = P.dirichlet(lab, 10, alpha, 10, rng(), min_size=20)
    check_exact_cover(parts, len(lab))
    assert min(len(p) for p in parts) >= 20


def test_dirichlet_small_alpha_is_skewed():
    lab = labels(100)
    parts = P.dirichlet(lab, 10, 0.05, 10, rng(), min_size=5)
    # with alpha -> 0 most clients hold few classes
    assert np.mean([len(h) for h in classes_of(parts, lab)]) < 6


def test_dirichlet_impossible_min_size():
    with pytest.raises(PartitionError, match="min_size = 100"):
        P.dirichlet(labels(), 10, 0.5, 10, rng(), min_size=100)


@pytest.mark.parametrize("k,c,alpha", [(20, 2, 0.5), (10, 3, 0.1), (15, 1, 1.0), (12, 10, 0.5)])
def test_exdir_clients_hold_at_most_c_classes_split_by_dirichlet(k, c, alpha):
    """Extended Dirichlet's defining properties: every sample once; a client holds at most C
    classes; every class has at least max(C K / classes // 2, 1) holders; every client min_size."""
    lab = labels(100)
    parts = P.exdir(lab, k, c, alpha, 10, rng(), 10)
    check_exact_cover(parts, len(lab))
    assert all(len(h) <= c for h in classes_of(parts, lab)) and min(len(p) for p in parts) >= 10
    holders = [sum(cls in h for h in classes_of(parts, lab)) for cls in range(10)]
    assert min(holders) >= 1  # (a holder can receive none of a class it drew: Dir(alpha) may give it 0)
    again = P.exdir(lab, k, c, alpha, 10, rng(), 10)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))  # the seed fixes it


def test_exdir_with_a_large_alpha_splits_each_class_evenly_among_its_holders():
    """alpha -> infinity: Dir(alpha) tends to equal proportions, so each class is cut into near-equal
    pieces among the clients that hold it (alpha = 100, PFLlib's exdir default)."""
    lab = labels(1000)
    parts = P.exdir(lab, 10, 2, 100.0, 10, rng(), 10)
    for cls in range(10):
        pieces = [int((lab[p] == cls).sum()) for p in parts if (lab[p] == cls).any()]
        assert max(pieces) / min(pieces) < 1.5, (cls, pieces)


def test_exdir_bad_input_is_one_sentence(tmp_path):
    import subprocess
    import sys

    with pytest.raises(PartitionError, match="classes_per_client = 11 is not allowed for partition exdir"):
        P.exdir(labels(), 5, 11, 0.5, 10, rng())
    with pytest.raises(PartitionError, match="has 4 class slots, fewer than the 10 classes"):
        P.exdir(labels(), 2, 2, 0.5, 10, rng())
    out = subprocess.run([sys.executable, "-m", "fedskew.cli", "run", "partition=exdir",
                          "partition.classes_per_client=11", "rounds=1", f"out_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "classes_per_client = 11 is not allowed for partition exdir" in out.stderr


def test_random_classes_draws_two_to_c_classes():
    """Replayed by hand: each client draws m ~ U{2..C} and m distinct classes, then a size factor
    ~ LogNormal(0, sigma); each class (shuffled) is cut among its holders at the cumulative shares of
    their factors. Every client's per-class count must be exactly that cut."""
    lab = labels(100)
    parts = P.random_classes(lab, 40, 10, rng(), size_sigma=0.3)
    check_exact_cover(parts, len(lab))
    replay = rng()
    drawn = []
    for _ in range(40):
        m = int(replay.integers(2, 11))
        drawn.append({int(c) for c in replay.choice(10, size=m, replace=False)})
    factors = replay.lognormal(0.0, 0.3, size=40)
    expected = np.zeros((40, 10), dtype=int)
    for c in range(10):
        who = [k for k in range(40) if c in drawn[k]]
        cuts = (np.cumsum(factors[who] / factors[who].sum())[:-1] * 100).astype(int)
        expected[who, c] = np.diff(np.concatenate([[0], cuts, [100]]))
    got = np.array([np.bincount(lab[p], minlength=10) for p in parts])
    assert np.array_equal(got, expected)
    assert {len(d) for d in drawn} >= {2, 5, 10} and min(len(d) for d in drawn) >= 2  # the whole range occurs
    # min_classes = C: every client holds every class
    full = P.random_classes(lab, 5, 10, rng(1), min_classes=10)
    assert all(h == list(range(10)) for h in classes_of(full, lab))


def test_iid_is_even():
    parts = P.iid(labels(), 7, rng())
    check_exact_cover(parts, 500)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_local_test_split_fraction_and_minimum():
    idx = np.arange(100, 110)
    tr, te = P.local_test_split(idx, 0.2, rng())
    assert len(te) == 2 and len(tr) == 8 and set(tr) | set(te) == set(idx)
    tr, te = P.local_test_split(np.arange(3), 0.05, rng())
    assert len(te) == 1  # at least one sample
    with pytest.raises(PartitionError, match="cannot hold out"):
        P.local_test_split(np.arange(1), 0.2, rng())


def test_federation_is_deterministic_and_disjoint():
    from fedskew.config import load_config
    from fedskew.data import load_federation

    cfg = load_config(None, ["partition.num_clients=10", "partition.classes_per_client=2"])
    a, b = load_federation(cfg), load_federation(cfg)
    for k in range(10):
        assert np.array_equal(a.train_idx[k], b.train_idx[k])
        assert not set(a.train_idx[k].tolist()) & set(a.test_idx[k].tolist())
    assert (a.counts("train") > 0).sum(1).tolist() == [2] * 10


# -- InnerDirichlet, size laws and Flower Datasets' partitioners (issue 48, item 2) -------------------


def test_inner_dirichlet_gives_every_client_its_size_and_a_prior_shaped_label_mix():
    lab = np.random.default_rng(1).permutation(labels(100))
    parts = P.inner_dirichlet(lab, 8, 0.05, 10, rng())
    check_exact_cover(parts, len(lab))
    assert sorted(len(p) for p in parts) == [125] * 8  # equal sizes: 1,000 / 8 exactly
    top = [np.bincount(lab[p], minlength=10).max() / len(p) for p in parts]
    assert np.mean(top) > 0.5  # alpha 0.05: a few classes dominate each client
    flat = P.inner_dirichlet(lab, 8, 1000.0, 10, rng())
    share = np.array([np.bincount(lab[p], minlength=10) / len(p) for p in flat])
    assert np.abs(share - 0.1).max() < 0.1  # alpha 1,000: every client near the global mix
    again = P.inner_dirichlet(lab, 8, 0.05, 10, rng())
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_client_sizes_follow_the_power_law_or_the_lognormal_and_add_up():
    sizes = P.client_sizes(1000, 5, rng(), size_exponent=1.0)
    exact = 1000 * np.array([1, 1 / 2, 1 / 3, 1 / 4, 1 / 5]) / sum([1, 1 / 2, 1 / 3, 1 / 4, 1 / 5])
    assert sizes.sum() == 1000 and np.abs(sizes - exact).max() < 1
    logn = P.client_sizes(1000, 5, rng(), size_sigma=1.0)
    assert logn.sum() == 1000 and len(set(logn.tolist())) == 5
    assert P.client_sizes(10, 4, rng()).tolist() == [3, 3, 2, 2]
    parts = P.inner_dirichlet(labels(100), 5, 0.5, 10, rng(), size_exponent=1.0)
    assert [len(p) for p in parts] == sizes.tolist()
    with pytest.raises(PartitionError, match=r"size_sigma = 1.0 and partition.size_exponent = 2.0 are both set"):
        P.client_sizes(1000, 5, rng(), 1.0, 2.0)
    with pytest.raises(PartitionError, match=r"gives client \d+ no sample \(100 samples among 10 clients\)"):
        P.client_sizes(100, 10, rng(), size_exponent=4.0)


def flower_partitions(partitioner, lab):
    datasets = pytest.importorskip("datasets")  # (with flwr-datasets, a test dependency: pyproject's `test` extra)

    partitioner.dataset = datasets.Dataset.from_dict({"label": lab, "row": np.arange(len(lab))})
    return [np.sort(partitioner.load_partition(i)["row"]) for i in range(partitioner.num_partitions)]


@pytest.mark.parametrize("sizes", [[125] * 8, [300, 200, 200, 150, 100, 50]])
def test_inner_dirichlet_is_flower_datasets_inner_dirichlet_partitioner(sizes):
    """The same sizes, alpha and generator seed: the same clients, sample for sample."""
    InnerDirichletPartitioner = pytest.importorskip("flwr_datasets.partitioner").InnerDirichletPartitioner

    lab = np.random.default_rng(1).permutation(labels(100))
    ours = P.inner_dirichlet_assign(lab, np.array(sizes), np.full(10, 0.3), rng(7))
    theirs = flower_partitions(InnerDirichletPartitioner(sizes, "label", 0.3, seed=7), lab)
    assert len(ours) == len(theirs) and all(np.array_equal(a, b) for a, b in zip(ours, theirs))


def test_a_flower_partitioner_in_the_config_partitions_as_it_does_alone():
    from fedskew.config import load_config

    DirichletPartitioner = pytest.importorskip("flwr_datasets.partitioner").DirichletPartitioner

    lab = np.random.default_rng(1).permutation(labels(100))
    cfg = load_config(None, ["partition=flwr", "partition.num_clients=6", "clients_per_round=3",
                             "partition.partitioner=DirichletPartitioner",
                             'partition.partitioner_options={"alpha": 0.5, "min_partition_size": 5, "seed": 3}'])
    parts = P.partition_labels(cfg.partition, lab, 10, rng())
    alone = flower_partitions(DirichletPartitioner(6, "label", 0.5, min_partition_size=5, seed=3), lab)
    assert all(np.array_equal(a, b) for a, b in zip(parts, alone)) and len(parts) == 6
    # the seed from the run's partition stream where the options give none: a fedskew seed decides it
    cfg = load_config(None, ["partition=flwr", "partition.num_clients=4", "clients_per_round=3",
                             "partition.partitioner=InnerDirichletPartitioner",
                             'partition.partitioner_options={"partition_sizes": [250, 250, 250, 250], "alpha": 0.5}'])
    a, b = (P.partition_labels(cfg.partition, lab, 10, rng(s)) for s in (0, 0))
    c = P.partition_labels(cfg.partition, lab, 10, rng(1))
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and not all(np.array_equal(x, y) for x, y in zip(a, c))
    seed = int(rng(0).integers(2**31))
    assert all(np.array_equal(x, y) for x, y in zip(a, P.inner_dirichlet_assign(lab, np.full(4, 250), np.full(10, 0.5),
                                                                                np.random.default_rng(seed))))
    check_exact_cover(a, len(lab))


@pytest.mark.parametrize("args, text", [
    (["partition.partitioner=Nope"], "partition.partitioner = 'Nope' is not a Flower Datasets partitioner; allowed: ["),
    (["partition.partitioner=IidPartitioner", 'partition.partitioner_options={"alpah": 1}'],
     "partition.partitioner_options ['alpah'] are not parameters of IidPartitioner; it takes ['num_partitions']"),
    (["partition.partitioner=InnerDirichletPartitioner",
      'partition.partitioner_options={"partition_sizes": [500, 500], "alpha": 0.5}'],
     "partition InnerDirichletPartitioner makes 2 partitions but partition.num_clients = 4; set them equal"),
])
def test_a_flower_partitioner_that_cannot_run_is_one_sentence(args, text):
    from fedskew.config import load_config

    pytest.importorskip("flwr_datasets")
    cfg = load_config(None, ["partition=flwr", "partition.num_clients=4", "clients_per_round=3", *args])
    with pytest.raises(PartitionError) as err:
        P.partition_labels(cfg.partition, labels(100), 10, rng())
    assert text in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("alpha", [0.01, 1e-300])
def test_inner_dirichlet_at_a_small_alpha_finishes_where_a_one_hot_prior_s_class_runs_out(alpha):
    """Issue 54: at alpha 0.01 a client's prior is one-hot; when its class runs out, Flower
    Datasets' partitioner divides by zero ("Probabilities contain NaN"). Here that client draws
    uniformly from the classes left: every sample is assigned once, every client gets its size."""
    lab = labels(100)
    sizes = np.array([300, 300, 200, 200])  # more than a class holds: some client must run out
    parts = P.inner_dirichlet_assign(lab, sizes, np.full(10, alpha), rng(3))
    assert [len(p) for p in parts] == sizes.tolist()
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat) == sizes.sum()
    with pytest.raises(PartitionError, match="partition.alpha = inf is not allowed"):
        P.inner_dirichlet(lab, 4, float("inf"), 10, rng())
