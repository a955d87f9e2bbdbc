"""Label-skew partitions (protocols.md, "Partitions").

Every partitioner takes the training labels, the number of clients and a numpy Generator (the
seed's ``partition`` stream) and returns one sorted index array per client. A request that cannot
be met raises :class:`PartitionError` with one sentence naming the field, the value and what is
allowed.
"""

from __future__ import annotations

import inspect
import math

import numpy as np


class PartitionError(ValueError):
    """A partition that cannot be built from the given labels and parameters."""


def _check_clients(num_clients: int, num_samples: int) -> None:
    if num_clients < 1:
        raise PartitionError(f"partition.num_clients = {num_clients} is not allowed; it must be at least 1.")
    if num_clients > num_samples:
        raise PartitionError(f"partition.num_clients = {num_clients} exceeds the {num_samples} training "
                             f"samples; every client needs at least one sample.")


def _split_classes_among_holders(labels: np.ndarray, holders: list[list[int]], num_clients: int,
                                 rng: np.random.Generator, shares: list[np.ndarray] | None = None
                                 ) -> list[np.ndarray]:
    """Shuffle each class and cut it among its holders (equal parts, or by ``shares[c]``)."""
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, who in enumerate(holders):
        idx = rng.permutation(np.flatnonzero(labels == c))
        if not who:
            continue
        if len(idx) < len(who):
            raise PartitionError(f"class {c} has {len(idx)} samples but {len(who)} clients hold it; "
                                 f"lower partition.num_clients or the classes per client.")
        if shares is None:
            pieces = np.array_split(idx, len(who))
        else:
            cuts = (np.cumsum(shares[c])[:-1] * len(idx)).astype(int)
            pieces = np.split(idx, cuts)
        for k, piece in zip(who, pieces):
            parts[k].append(piece)
    out = [np.sort(np.concatenate(p)) if p else np.empty(0, dtype=np.int64) for p in parts]
    empty = [k for k, p in enumerate(out) if len(p) == 0]
    if empty:
        raise PartitionError(f"clients {empty[:5]} would receive no samples; lower partition.num_clients.")
    return out


def _holders_from_classes(client_classes: list[list[int]], num_classes: int, name: str) -> list[list[int]]:
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for k, classes in enumerate(client_classes):
        for c in classes:
            holders[c].append(k)
    missing = [c for c, h in enumerate(holders) if not h]
    if missing:
        raise PartitionError(f"partition '{name}' left classes {missing} with no holder; "
                             f"raise partition.num_clients or the classes per client.")
    return holders


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle all samples and split them into ``num_clients`` near-equal parts."""
    _check_clients(num_clients, len(labels))
    return [np.sort(p) for p in np.array_split(rng.permutation(len(labels)), num_clients)]


def pcdd_classes(num_clients: int, classes_per_client: int, num_classes: int,
                 rng: np.random.Generator) -> list[list[int]]:
    """The class sets of the FedMR "PxCy" partition.

    Classes are dealt in order with a running counter (client 0 takes 0..y-1, client 1 the next y,
    ...) until every class has been dealt once; each remaining slot then takes a uniformly random
    class that the client does not already hold.
    """
    _check_class_slots("pcdd", num_clients, classes_per_client, num_classes)
    counter = 0
    out: list[list[int]] = []
    for _ in range(num_clients):
        held: list[int] = []
        while len(held) < classes_per_client and counter < num_classes:
            held.append(counter)
            counter += 1
        while len(held) < classes_per_client:
            choices = np.setdiff1d(np.arange(num_classes), held)
            held.append(int(rng.choice(choices)))
        out.append(sorted(held))
    return out


def pcdd(labels: np.ndarray, num_clients: int, classes_per_client: int, num_classes: int,
         rng: np.random.Generator) -> list[np.ndarray]:
    """FedMR's "PxCy": x clients with y classes each; each class split once, equally, among its
    holders (the reference code's double split that duplicates samples is not reproduced). Every
    class on every client (y = the class count) is IID."""
    if classes_per_client == num_classes:
        return iid(labels, num_clients, rng)
    _check_clients(num_clients, len(labels))
    classes = pcdd_classes(num_clients, classes_per_client, num_classes, rng)
    return _split_classes_among_holders(labels, _holders_from_classes(classes, num_classes, "pcdd"),
                                        num_clients, rng)


def label_k(labels: np.ndarray, num_clients: int, classes_per_client: int, num_classes: int,
            rng: np.random.Generator) -> list[np.ndarray]:
    """NIID-Bench's "#C=k": client i holds class i mod C plus k-1 distinct random others."""
    _check_clients(num_clients, len(labels))
    k = classes_per_client
    if not 1 <= k <= num_classes:
        raise PartitionError(f"partition.classes_per_client = {k} is not allowed; it must be between 1 "
                             f"and the {num_classes} classes.")
    classes = []
    for i in range(num_clients):
        first = i % num_classes
        others = rng.choice(np.setdiff1d(np.arange(num_classes), [first]), size=k - 1, replace=False)
        classes.append(sorted([first, *(int(c) for c in others)]))
    return _split_classes_among_holders(labels, _holders_from_classes(classes, num_classes, "label_k"),
                                        num_clients, rng)


def dirichlet(labels: np.ndarray, num_clients: int, alpha: float, num_classes: int,
              rng: np.random.Generator, min_size: int = 10, *, max_tries: int = 1000) -> list[np.ndarray]:
    """NIID-Bench's Dir(alpha): per class, proportions ~ Dir(alpha) over clients; a client that
    already holds >= N/K samples gets no more; the whole draw repeats until every client holds at
    least ``min_size`` samples (at most ``max_tries`` times)."""
    _check_dirichlet(labels, num_clients, alpha, min_size)
    return _dirichlet_split("dirichlet", labels, num_clients, alpha, [list(range(num_clients))] * num_classes, rng,
                            min_size, max_tries)


def exdir(labels: np.ndarray, num_clients: int, classes_per_client: int, alpha: float, num_classes: int,
          rng: np.random.Generator, min_size: int = 10, *, max_tries: int = 1000) -> list[np.ndarray]:
    """Extended Dirichlet (Li et al., arXiv 2311.03154; PFLlib's ``exdir``): each
    client draws ``classes_per_client`` = C distinct classes uniformly, again until every class has
    at least max(C K / num_classes // 2, 1) holders; then each class is split among its holders
    alone by Dir(alpha) proportions, as :func:`dirichlet` (a client over N/K samples gets no more;
    what rounding leaves goes to the class's last holder), the whole split drawn again until every
    client holds ``min_size`` samples. A client holds at most C classes."""
    _check_dirichlet(labels, num_clients, alpha, min_size)
    c = classes_per_client
    _check_class_slots("exdir", num_clients, c, num_classes)
    need = max(c * num_clients // num_classes // 2, 1)
    for _ in range(max_tries):
        holders: list[list[int]] = [[] for _ in range(num_classes)]
        for i in range(num_clients):
            for k in rng.choice(num_classes, size=c, replace=False):
                holders[int(k)].append(i)
        if min(len(h) for h in holders) >= need:
            break
    else:
        raise PartitionError(f"partition exdir could not give every class {need} holders in {max_tries} draws; "
                             f"raise partition.classes_per_client or num_clients.")
    return _dirichlet_split("exdir", labels, num_clients, alpha, [sorted(h) for h in holders], rng, min_size,
                            max_tries)


def _check_class_slots(name: str, num_clients: int, classes_per_client: int, num_classes: int) -> None:
    """C classes per client: 1 <= C <= the class count, and at least one holder for every class."""
    if not 1 <= classes_per_client <= num_classes:
        raise PartitionError(f"partition.classes_per_client = {classes_per_client} is not allowed for partition "
                             f"{name}; it must be between 1 and the {num_classes} classes.")
    if num_clients * classes_per_client < num_classes:
        raise PartitionError(f"partition {name} with num_clients = {num_clients} and classes_per_client = "
                             f"{classes_per_client} has {num_clients * classes_per_client} class slots, fewer than "
                             f"the {num_classes} classes; every class needs a holder.")


def _check_dirichlet(labels: np.ndarray, num_clients: int, alpha: float, min_size: int) -> None:
    _check_clients(num_clients, len(labels))
    if alpha <= 0:
        raise PartitionError(f"partition.alpha = {alpha} is not allowed; it must be positive.")
    if min_size * num_clients > len(labels):
        raise PartitionError(f"partition.min_size = {min_size} times {num_clients} clients exceeds the "
                             f"{len(labels)} training samples; lower min_size or num_clients.")


def _dirichlet_split(name: str, labels: np.ndarray, num_clients: int, alpha: float, holders: list[list[int]],
                     rng: np.random.Generator, min_size: int, max_tries: int) -> list[np.ndarray]:
    """:func:`_dirichlet_draw` again until every client holds ``min_size`` samples."""
    for _ in range(max_tries):
        parts = _dirichlet_draw(labels, num_clients, alpha, holders, rng)
        if min(len(q) for q in parts) >= min_size:
            return parts
    raise PartitionError(f"partition {name} with alpha = {alpha} gave some client fewer than min_size = {min_size} "
                         f"samples in {max_tries} draws; raise alpha or lower min_size.")


def _dirichlet_draw(labels: np.ndarray, num_clients: int, alpha: float, holders: list[list[int]],
                    rng: np.random.Generator) -> list[np.ndarray]:
    """One Dir(alpha) split of every class c among ``holders[c]`` (sorted client ids): proportions
    drawn over all clients, zero for a client that is not a holder or already holds >= N/K samples,
    renormalised (uniform over the holders if none is left); the last holder takes what rounding
    leaves."""
    n = len(labels)
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for c, held in enumerate(holders):
        idx = rng.permutation(np.flatnonzero(labels == c))
        p = rng.dirichlet(np.full(num_clients, alpha))
        mask = np.zeros(num_clients, dtype=bool)
        mask[held] = True
        sizes = np.array([len(q) for q in parts])
        p = p * (sizes < n / num_clients) * mask
        p = p / p.sum() if p.sum() > 0 else mask / mask.sum()
        cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
        cuts[held[-1]:] = len(idx)  # (no-op when every client holds c)
        for k, piece in enumerate(np.split(idx, cuts)):
            parts[k].extend(piece.tolist())
    return [np.sort(np.asarray(q, dtype=np.int64)) for q in parts]


def client_sizes(total: int, num_clients: int, rng: np.random.Generator, size_sigma: float = 0.0,
                 size_exponent: float = 0.0, *, name: str = "inner_dirichlet") -> np.ndarray:
    """How many of ``total`` samples each client holds: equal; LogNormal(0, ``size_sigma``)
    weights (FedDyn's unbalanced clients, ``unbalanced_sgm``); or a power law, client k's weight
    (k + 1) ** -``size_exponent``. Sizes are the weights' shares of ``total``, rounded down, the
    remainder given one by one to the largest fractional parts; every client holds one or more."""
    _check_clients(num_clients, total)
    if size_sigma > 0 and size_exponent > 0:
        raise PartitionError(f"partition.size_sigma = {size_sigma} and partition.size_exponent = {size_exponent} "
                             f"are both set; {name} takes one size law (LogNormal or power law).")
    if size_sigma > 0:
        weights = rng.lognormal(0.0, size_sigma, size=num_clients)
    else:
        weights = np.arange(1, num_clients + 1, dtype=float) ** -size_exponent
    exact = weights / weights.sum() * total
    sizes = np.floor(exact).astype(np.int64)
    sizes[np.argsort(-(exact - sizes), kind="stable")[: total - sizes.sum()]] += 1
    if sizes.min() < 1:
        raise PartitionError(f"partition {name} gives client {int(sizes.argmin())} no sample ({total} samples among "
                             f"{num_clients} clients); lower partition.size_sigma or partition.size_exponent.")
    return sizes


def inner_dirichlet(labels: np.ndarray, num_clients: int, alpha: float, num_classes: int, rng: np.random.Generator,
                    size_sigma: float = 0.0, size_exponent: float = 0.0) -> list[np.ndarray]:
    """InnerDirichlet (Acar et al., FedDyn, ICLR 2021; Flower Datasets' ``InnerDirichletPartitioner``):
    client sizes fixed first (:func:`client_sizes`), each client's class prior ~ Dir(alpha); then,
    sample by sample, a client that still has room is drawn uniformly and a class from its prior
    (a class run out has its probability set to 0 for every client, the priors renormalised), and
    it takes that class's last unassigned sample. The draws are Flower Datasets' own, in its order:
    with its generator the assignment is its assignment (tests/test_partitions.py). Where a
    client's prior holds only classes that ran out (a one-hot prior at a small alpha), it draws
    uniformly from the classes left; Flower Datasets stops there with NaN probabilities."""
    if not 0 < alpha < math.inf:
        raise PartitionError(f"partition.alpha = {alpha} is not allowed; it must be > 0 and finite.")
    sizes = client_sizes(len(labels), num_clients, rng, size_sigma, size_exponent)
    return inner_dirichlet_assign(labels, sizes, np.full(num_classes, float(alpha)), rng)


def inner_dirichlet_assign(labels: np.ndarray, sizes: np.ndarray, alpha: np.ndarray, rng: np.random.Generator
                           ) -> list[np.ndarray]:
    """:func:`inner_dirichlet`'s assignment for given client ``sizes`` and per-class ``alpha``."""
    num_clients, num_classes = len(sizes), len(alpha)
    priors = rng.dirichlet(alpha=alpha, size=num_clients)
    pools = [np.flatnonzero(labels == c) for c in range(num_classes)]
    left_in_class = [len(q) for q in pools]
    parts = [np.zeros(n, dtype=np.int64) for n in sizes]
    room = dict(zip(range(num_clients), (int(n) for n in sizes)))
    open_clients = list(range(num_clients))
    classes = list(range(num_classes))
    left = int(sum(room.values()))
    while left:
        k = rng.choice(open_clients)
        if room[k] == 0:
            open_clients.remove(k)
            continue
        room[k] -= 1
        left -= 1
        while True:
            c = rng.choice(classes, p=priors[k])
            if left_in_class[c] == 0:  # run out: never drawn again, by any client
                priors[:, c] = 0
                mass = priors.sum(axis=1, keepdims=True)
                # a client whose prior held only classes that ran out (a one-hot prior at a small
                # alpha) draws uniformly from the classes left (Flower Datasets divides by 0 here)
                empty = mass[:, 0] == 0
                priors = priors / np.where(empty[:, None], 1, mass)
                if empty.any():
                    priors[empty] = (np.array(left_in_class) > 0) / sum(n > 0 for n in left_in_class)
                continue
            left_in_class[c] -= 1
            parts[k][room[k]] = pools[c][left_in_class[c]]
            break
    return [np.sort(q) for q in parts]


def flwr(labels: np.ndarray, num_clients: int, partitioner: str | None, partitioner_options: dict,
         rng: np.random.Generator) -> list[np.ndarray]:
    """A Flower Datasets partitioner (``flwr_datasets.partitioner.<partitioner>``, built with
    ``partitioner_options``) applied to the training labels (a ``label`` column): its partitions,
    as index arrays. ``num_partitions`` is ``num_clients`` unless the options give it (or
    ``partition_sizes``), ``partition_by`` is ``label``, and ``seed`` (where the partitioner takes
    one) comes from the run's partition stream unless given. Needs ``pip install flwr-datasets``."""
    try:
        import datasets
        import flwr_datasets.partitioner as fp
    except ImportError:
        raise PartitionError("partition flwr needs Flower Datasets: pip install flwr-datasets.") from None
    names = sorted(n for n in fp.__all__ if n.endswith("Partitioner") and n != "Partitioner")
    cls = getattr(fp, partitioner or "", None)
    if partitioner not in names:
        raise PartitionError(f"partition.partitioner = {partitioner!r} is not a Flower Datasets partitioner; "
                             f"allowed: {names}.")
    takes = inspect.signature(cls).parameters
    options = dict(partitioner_options)
    if "num_partitions" in takes:
        options.setdefault("num_partitions", num_clients)
    if "partition_by" in takes:
        options.setdefault("partition_by", "label")
    if "seed" in takes:
        options.setdefault("seed", int(rng.integers(2**31)))
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise PartitionError(f"partition.partitioner_options {unknown} are not parameters of {partitioner}; it takes "
                             f"{sorted(set(takes) - {'self'})}.")
    try:
        part = cls(**options)
        part.dataset = datasets.Dataset.from_dict({"label": labels.astype(np.int64), "_row": np.arange(len(labels))})
        count = part.num_partitions
        if count != num_clients:
            raise PartitionError(f"partition {partitioner} makes {count} partitions but partition.num_clients = "
                                 f"{num_clients}; set them equal.")
        return [np.sort(np.asarray(part.load_partition(i)["_row"], dtype=np.int64)) for i in range(count)]
    except PartitionError:
        raise
    except (ValueError, TypeError, KeyError, AssertionError, ArithmeticError, IndexError, MemoryError) as exc:
        # (Flower Datasets' own checks, and what its arithmetic raises on options out of range:
        # ShardPartitioner divides by zero at 1e9 shards a partition)
        why = (str(exc).splitlines() or [""])[0][:200].rstrip(".") or type(exc).__name__
        raise PartitionError(f"partition {partitioner} with {partitioner_options} failed: {why}.") from None


def random_classes(labels: np.ndarray, num_clients: int, num_classes: int, rng: np.random.Generator,
                   size_sigma: float = 0.0, min_classes: int = 2) -> list[np.ndarray]:
    """MAP's partition: each client draws its number of classes uniformly from {min_classes..C}
    and that many distinct classes; with ``size_sigma > 0`` it also draws a size factor
    ~ LogNormal(0, size_sigma). Each class is cut among its holders in proportion to their factors."""
    _check_clients(num_clients, len(labels))
    if not 1 <= min_classes <= num_classes:
        raise PartitionError(f"partition.min_classes = {min_classes} is not allowed; it must be between "
                             f"1 and the {num_classes} classes.")
    classes = []
    for _ in range(num_clients):
        m = int(rng.integers(min_classes, num_classes + 1))
        classes.append(sorted(int(c) for c in rng.choice(num_classes, size=m, replace=False)))
    factors = rng.lognormal(0.0, size_sigma, size=num_clients) if size_sigma > 0 else np.ones(num_clients)
    holders = _holders_from_classes(classes, num_classes, "random_classes")
    shares = [factors[h] / factors[h].sum() for h in holders]
    return _split_classes_among_holders(labels, holders, num_clients, rng, shares)


def local_test_split(indices: np.ndarray, fraction: float, rng: np.random.Generator
                     ) -> tuple[np.ndarray, np.ndarray]:
    """MAP protocol: shuffle a client's samples and hold out ``fraction`` (at least 1) as its local
    test set. Returns sorted (train, test)."""
    if fraction <= 0:
        return np.sort(indices), np.empty(0, dtype=np.int64)
    perm = rng.permutation(indices)
    n_test = max(1, int(round(fraction * len(perm))))
    if n_test >= len(perm):
        raise PartitionError(f"a client with {len(perm)} samples cannot hold out a local test split "
                             f"(partition.local_test_fraction = {fraction}); lower the fraction or num_clients.")
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def label_count(labels: np.ndarray, num_clients: int, classes_per_client: int, samples_per_class: int,
                num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """The neural-collapse paper's "C-K-n" split (e.g. Cifar10-100-5 with n samples per class):
    K clients with k classes each, dealt as in pcdd (every class gets a holder first, then random
    distinct classes), and exactly n samples of each held class per client, drawn without
    replacement, so clients never share a sample. Samples no client draws are left out."""
    _check_clients(num_clients, len(labels))
    classes = pcdd_classes(num_clients, classes_per_client, num_classes, rng)
    holders = _holders_from_classes(classes, num_classes, "label_count")
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, who in enumerate(holders):
        idx = rng.permutation(np.flatnonzero(labels == c))
        if len(idx) < len(who) * samples_per_class:
            raise PartitionError(f"partition.samples_per_class = {samples_per_class} is not allowed here: class {c} "
                                 f"has {len(idx)} samples for {len(who)} holders; at most "
                                 f"{len(idx) // len(who)} fit.")
        for j, k in enumerate(who):
            parts[k].append(idx[j * samples_per_class:(j + 1) * samples_per_class])
    return [np.sort(np.concatenate(p)) for p in parts]


def shards(labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator
           ) -> list[np.ndarray]:
    """The FedAvg paper's pathological split: sort the samples by label (ties in random order),
    cut them into K * s near-equal shards and give each client s shards drawn at random."""
    _check_clients(num_clients, len(labels))
    total = num_clients * shards_per_client
    if total > len(labels):
        raise PartitionError(f"partition.shards_per_client = {shards_per_client} with {num_clients} clients asks "
                             f"for {total} shards of {len(labels)} samples; every shard needs a sample.")
    order = np.lexsort((rng.permutation(len(labels)), labels))  # by label, random within a label
    pieces = np.array_split(order, total)
    owner = rng.permutation(total).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([pieces[i] for i in row])) for row in owner]


def natural(groups: np.ndarray | None, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """One client per natural user (LEAF writer or role): ``num_clients`` users drawn at random
    (stream ``partition``; all of them in user order when num_clients equals their number)."""
    if groups is None:
        raise PartitionError("partition.name = 'natural' needs a data set with natural clients (femnist, "
                             "shakespeare); use another partition for this data set.")
    users = int(groups.max()) + 1 if len(groups) else 0
    if num_clients > users:
        raise PartitionError(f"partition.num_clients = {num_clients} exceeds the {users} users of the data set; "
                             f"allowed: 1..{users}.")
    picked = np.arange(users) if num_clients == users else np.sort(rng.choice(users, num_clients, replace=False))
    return [np.flatnonzero(groups == u) for u in picked]


# Each partition's builder. Its positional parameters other than FROM_DATA are keys of the
# ``partition`` section of the same name (keyword-only ones are not configurable): what
# PartitionConfig.applies() accepts is read from these signatures.
PARTITIONERS = {"iid": iid, "pcdd": pcdd, "label_k": label_k, "dirichlet": dirichlet, "exdir": exdir,
                "inner_dirichlet": inner_dirichlet, "random_classes": random_classes, "label_count": label_count,
                "shards": shards, "natural": natural, "flwr": flwr}
PARTITIONS = tuple(PARTITIONERS)
FROM_DATA = frozenset({"labels", "num_clients", "num_classes", "rng", "groups"})  # (num_clients: a common key)


def partition_keys(name: str) -> set[str]:
    """The ``partition`` section's keys that partition ``name`` reads (besides name and num_clients)."""
    return set(_config_params(PARTITIONERS[name])) - FROM_DATA


def _config_params(build) -> list[str]:
    return [n for n, p in inspect.signature(build).parameters.items() if p.kind is not p.KEYWORD_ONLY]


def partition_labels(cfg, labels: np.ndarray, num_classes: int, rng: np.random.Generator,
                     groups: np.ndarray | None = None) -> list[np.ndarray]:
    """Dispatch on a :class:`fedskew.config.PartitionConfig` (``groups``: each sample's natural
    user, for ``natural``): the builder of ``cfg.name`` with its keys from ``cfg``."""
    build = PARTITIONERS.get(cfg.name)
    if build is None:
        raise PartitionError(f"partition.name '{cfg.name}' is not known; allowed: {list(PARTITIONS)}.")
    data = {"labels": labels, "num_clients": cfg.num_clients, "num_classes": num_classes, "rng": rng,
            "groups": groups}
    return build(**{p: data[p] if p in FROM_DATA else getattr(cfg, p) for p in _config_params(build)})
