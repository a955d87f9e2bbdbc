"""Clustered and multi-model federations: CFL (Sattler et al., 2021: clusters split by the cosine similarity of the
clients' updates) and FedConcat (Diao, Li and He, AAAI 2024, "Exploiting Label Skews in
Federated Learning with Model Concatenation"; the authors' code, sjtudyq/FedConcat,
``experiments.py``, ``alg == 'fedconcat'``); and FedCross (Hu et al., ICDE 2024), whose server
trains K middleware models side by side and cross-aggregates them in pairs.

The clients are clustered by their label distributions (k-means on the rows of n_k,c / n_k); in a
first phase each cluster trains its own model (encoder + linear classifier) by FedAvg among its
members; in a second phase the K encoders are frozen and concatenated, z = [z_1, ..., z_K], and
one linear classifier over z (K d -> C) is trained by all clients, a few mini-batches per round,
averaged with equal weights.

In fedskew the model is the concatenation from the start (``FedConcat.build_model``: K branches,
:class:`~fedskew.models.nets.Branches`): cluster c's model is branch c with block c of the
classifier (columns c d .. (c + 1) d) and its own bias b_c (kept by the server), so the two phases
are two uses of one architecture and need no special case in the round loop: the phase is the
server's round count (``broadcast``), the second phase's step budget ``Method.local_steps``. The
global model of the first phase is the concatenation with classifier [W_1 ... W_K] and bias
sum_c b_c, whose logits are the sum of the cluster models' logits.
"""

from __future__ import annotations

import math
import warnings
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import (
    FedAvgOptions,
    Method,
    Source,
    StrictOptions,
    as_model_part,
    builtin,
    copies,
    model_part,
    strip_prefix,
    weighted_mean,
)
from fedskew.models.nets import Branches, SkewNet
from fedskew.streams import numpy_rng, stream_key

BRANCH = "backbone.branches."
HEAD_W, HEAD_B = "classifier.weight", "classifier.bias"


def label_clusters(class_counts: torch.Tensor, k: int, seed: int) -> np.ndarray:
    """Cluster of every client: k-means (scikit-learn, k-means++, 10 starts, seeded from stream
    ``fedconcat_kmeans``) on the label distributions n_k,c / n_k, as the authors' code does
    (``KMeans(n_clusters).fit(client_distribution)``). Identical distributions may leave a cluster
    empty (its branch is then never trained)."""
    from sklearn.cluster import KMeans  # scikit-learn is a dependency (digits, SVHN's loader)

    counts = class_counts.double()
    dist = (counts / counts.sum(1, keepdim=True).clamp_min(1)).numpy()
    with warnings.catch_warnings():  # "fewer distinct clusters than n_clusters": said in the docstring
        warnings.simplefilter("ignore")
        km = KMeans(n_clusters=k, n_init=10, random_state=stream_key(seed, "fedconcat_kmeans")[0] % (2 ** 31))
        return km.fit(dist).labels_.astype(np.int64)


class FedConcatOptions(StrictOptions):
    search = {"classifier_init": ["fresh", "clusters"]}  # the bench's search space (fedskew bench)
    clusters: int = Field(5, ge=2, le=64, description=
        "K, clusters of clients by label distribution (k-means), one encoder each, the branches of the "
        "model (the authors' default n_clusters 5)")
    encoder_rounds: int | None = Field(None, ge=1, description=
        "rounds of the first phase (per-cluster FedAvg of encoder + classifier); the rest train the concatenated "
        "classifier. None: half the run's rounds (the authors run 50 encoder rounds, then 1000 classifier rounds)")
    classifier_steps: int = Field(3, ge=1, description=
        "mini-batches per client per round in the second phase, at most one epoch (the authors' code: 3)")
    classifier_init: Literal["fresh", "clusters"] = Field("fresh", description=
        "the concatenated classifier's start: fresh, a new initialisation (the authors' code for its 10-class data "
        "sets); clusters, the cluster classifiers side by side with the sum of their biases (their code for "
        "CIFAR-100 and Tiny-ImageNet, 'to speed up convergence')")


@builtin
class FedConcat(Method):
    """FedConcat (Diao, Li and He, AAAI 2024), Algorithm 1 as the authors' code runs it:
    clients clustered by k-means on their label distributions (:func:`label_clusters`); rounds
    < ``encoder_rounds``: each client trains its cluster's model (branch c, classifier block W_c,
    bias b_c; logits W_c z_c + b_c, cross-entropy, E epochs) and the server averages each cluster
    over its members by samples; then the branches are frozen and each selected client takes
    ``classifier_steps`` SGD steps of cross-entropy on the concatenated classifier (features from
    the received encoders in eval mode), which the server averages with equal weights (the
    authors: "we move 3 steps for all clients, so this average should be unweighted").

    Differences from the authors' code, said here: their clusters start from one shared
    initialisation, fedskew's branches from their own draws; the fresh classifier is the run's
    initial one (drawn for K d inputs), not a second draw; BatchNorm statistics of the frozen
    encoders are the received ones (eval mode), theirs update in train mode. Down: the whole
    concatenated model every round (a client needs only its branch in the first phase, and only
    the classifier after the first round of the second: K times, and more, what their simulation
    would send). Up: the client's branch, block and bias in the first phase, the classifier in the
    second."""

    name = "fedconcat"
    Options = FedConcatOptions
    source = Source(
        authors="Diao, Li, He",
        title="Exploiting Label Skews in Federated Learning with Model Concatenation",
        venue="AAAI",
        arxiv="2312.06290", year=2024,
        implements="Algorithm 1",
        code="sjtudyq/FedConcat")
    requires_classifier = "linear"
    fedavg_weighted = False  # per-cluster means, then an unweighted mean (Method.fedavg_weighted)
    per_sample_loss = True  # Method.padding_exact

    @classmethod
    def build_model(cls, model, options, rebuild):
        """K = ``clusters`` backbones of the same configuration (the first the configured model's,
        the others drawn next), their features concatenated (K d) before a new classifier."""
        backbones = [model.backbone] + [rebuild().backbone for _ in range(options.clusters - 1)]
        return SkewNet(Branches(backbones), options.clusters * model.feature_dim, model.classifier.out_features,
                       model.classifier.bias is not None)

    def __init__(self, options=None, info=None):
        super().__init__(options, info)
        k = self.opt.clusters
        self.switch = self.opt.encoder_rounds
        self.assign = None
        if info is None or not info.param_names:
            return
        if info.num_clients < k:
            raise ValueError(f"method.clusters = {k} exceeds partition.num_clients = {info.num_clients}")
        if self.switch is None:
            self.switch = math.ceil(info.rounds / 2)
        self.assign = label_clusters(info.class_counts, k, info.seed)

    @staticmethod
    def _phase2(payload) -> bool:
        """The phase is in the payload's keys, not a value: a loss under ``vmap`` may branch on it."""
        return "concat.phase2" in payload

    def _block(self, c: int, d: int) -> slice:
        return slice(c * d, (c + 1) * d)

    def server_init(self, global_state, info):
        state = {"concat.round": torch.zeros((), dtype=torch.long),
                 "concat.init_weight": global_state[HEAD_W].clone()}
        if HEAD_B in global_state:  # every cluster's bias starts at the one initial draw
            state["concat.init_bias"] = global_state[HEAD_B].clone()
            state["concat.bias"] = global_state[HEAD_B].expand(self.opt.clusters, -1).clone()
        return state

    def client_init(self, client_id, global_state, info):
        onehot = torch.zeros(self.opt.clusters, device=global_state[HEAD_W].device)
        onehot[int(self.assign[client_id])] = 1.0
        return {"concat.cluster": onehot}

    def broadcast(self, global_state, server_state):
        payload = as_model_part(global_state)
        if server_state["concat.round"] >= self.switch:
            payload["concat.phase2"] = torch.ones(1, device=global_state[HEAD_W].device)
        elif "concat.bias" in server_state:
            payload["concat.bias"] = server_state["concat.bias"]  # the cluster biases b_c (K x C)
        return payload

    def local_start(self, payload, client_state):
        """Phase 1: the client's cluster model inside the concatenation (the other classifier
        blocks zero, the cluster's bias); phase 2: the received model."""
        start = model_part(payload)
        if self._phase2(payload):
            return start
        onehot = client_state["concat.cluster"]
        start[HEAD_W] = start[HEAD_W] * onehot.repeat_interleave(start[HEAD_W].shape[1] // len(onehot))
        if HEAD_B in start:
            start[HEAD_B] = onehot @ payload["concat.bias"]
        return start

    def local_loss(self, fwd, params, x, y, payload, client_state):
        """Phase 1: CE(W_c z_c + b_c) of the client's cluster c (only its branch and block get a
        gradient); phase 2: CE of the classifier on the frozen concatenated features."""
        if self._phase2(payload):
            z, _ = fwd.frozen(model_part(payload), x)
            return fwd.cross_entropy(fwd.head(z), y), {}
        z, _ = fwd(x)
        onehot = client_state["concat.cluster"]
        mask = onehot.repeat_interleave(z.shape[-1] // len(onehot))  # 1 on branch c's features
        return fwd.cross_entropy(F.linear(z * mask, params[HEAD_W], params.get(HEAD_B)), y), {}

    def local_steps(self, round_idx, total_steps, steps_per_epoch):
        if self.switch is not None and round_idx >= self.switch:
            return min(self.opt.classifier_steps, steps_per_epoch)
        return total_steps

    def after_training(self, trained, payload, client_state, report):
        if self._phase2(payload):
            return as_model_part({k: v for k, v in trained.items() if k.startswith("classifier.")}), client_state
        c = int(client_state["concat.cluster"].argmax())
        d = trained[HEAD_W].shape[1] // self.opt.clusters
        upload = {"concat.enc." + k: v for k, v in strip_prefix(trained, f"{BRANCH}{c}.").items()}
        upload["concat.weight"] = trained[HEAD_W][:, self._block(c, d)]
        if HEAD_B in trained:
            upload["concat.bias"] = trained[HEAD_B]
        return upload, client_state

    def aggregate(self, server_state, global_state, uploads, reports):
        """Phase 1: each cluster's branch, block and bias <- the sample-weighted mean over its
        selected members (a cluster without one keeps its model); the global bias is sum_c b_c.
        Phase 2: the classifier <- the unweighted mean. After the last phase-1 round,
        ``classifier_init`` sets the concatenated classifier's start."""
        new, server = dict(global_state), dict(server_state)
        if server["concat.round"] >= self.switch:
            new.update(weighted_mean([model_part(u) for u in uploads],
                                     torch.full((len(uploads),), 1.0 / len(uploads), dtype=torch.float64)))
        else:
            d = new[HEAD_W].shape[1] // self.opt.clusters
            weight = new[HEAD_W].clone()
            bias = server.get("concat.bias")
            bias = bias.clone() if bias is not None else None
            for c in range(self.opt.clusters):
                members = [i for i, r in enumerate(reports) if self.assign[r.client_id] == c]
                if not members:
                    continue
                n = torch.tensor([reports[i].num_samples for i in members], dtype=torch.float64)
                mean = weighted_mean([strip_prefix(uploads[i], "concat.") for i in members], n / n.sum())
                new.update({f"{BRANCH}{c}.{k[4:]}": v for k, v in mean.items() if k.startswith("enc.")})
                weight[:, self._block(c, d)] = mean["weight"]
                if bias is not None:
                    bias[c] = mean["bias"]
            new[HEAD_W] = weight
            if bias is not None:
                server["concat.bias"], new[HEAD_B] = bias, bias.sum(0)
        server["concat.round"] = server["concat.round"] + 1
        if int(server["concat.round"]) == self.switch and self.opt.classifier_init == "fresh":
            new[HEAD_W] = server["concat.init_weight"].clone()
            if HEAD_B in new:
                new[HEAD_B] = server["concat.init_bias"].clone()
        return new, server


SENT_CFL = "cfl.model."  # the client's cluster model, downloaded for the round


class CFLOptions(StrictOptions):
    search = {"eps_1": [0.2, 0.4], "eps_2": [0.8, 1.6]}  # the bench's search space (fedskew bench)
    eps_1: float = Field(0.4, gt=0, allow_inf_nan=False,
                         description="split a cluster when the norm of its members' mean update is below it")
    eps_2: float = Field(1.6, gt=0, allow_inf_nan=False,
                         description="... and the largest member update norm is above it")
    min_cluster_size: int = Field(2, ge=1, description="... and it has more members than this")
    start_round: int = Field(20, ge=0, description="... from this round on (counted from 0)")


def bipartition(similarity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CFL's split (Sattler et al., Algorithm 1): two groups of a cluster's members by complete-linkage
    agglomerative clustering on the distance -similarity (FL-bench's ``cluster_clients``)."""
    from sklearn.cluster import AgglomerativeClustering

    labels = AgglomerativeClustering(metric="precomputed", linkage="complete").fit(-similarity).labels_
    return np.flatnonzero(labels == 0), np.flatnonzero(labels == 1)


@builtin
class CFL(Method):
    """Clustered FL (Sattler, Mueller and Samek, IEEE TNNLS 2021, Algorithm 1; FL-bench's ``cfl``).
    Every client trains its cluster's model; the server averages each cluster's updates (uniform
    weights) into that cluster's model. A cluster whose members' mean update is small (norm <
    eps_1: near a stationary point of their joint objective) while one member's update is large
    (norm > eps_2: they disagree), with more than ``min_cluster_size`` members, from round
    ``start_round`` on, is split in two by complete-linkage clustering of the cosine similarities of
    the round's updates (clients that did not train this round: similarity 0 to the others, as in
    FL-bench); both halves start from its model. No global model: each client is scored with its
    locally trained model (``personal/*``), its cluster's model being the final pass's
    ``personal/final_acc_before``."""

    @classmethod
    def inert(cls, options, rounds, num_clients, clients_per_round):
        if options.start_round >= rounds:
            return (f"start_round = {options.start_round} is not below rounds = {rounds}: no cluster is ever split, "
                    f"so this run is FedAvg")
        if options.min_cluster_size >= num_clients:
            return (f"min_cluster_size = {options.min_cluster_size} is not below the {num_clients} clients: a "
                    f"cluster needs more members than that to split, so none is ever split and this run is FedAvg")

    name = "cfl"
    Options = CFLOptions
    source = Source(authors="Sattler, Mueller, Samek",
                    title="Clustered Federated Learning: Model-Agnostic Distributed Multitask Optimization "
                          "Under Privacy Constraints", venue="IEEE TNNLS", year=2021, arxiv="1910.01991",
                    implements="Algorithm 1 (the split criterion Eq. 27-28 with eps_1, eps_2; bipartition)",
                    code="KarhouTam/FL-bench src/server/cfl.py (the split, its defaults, uniform cluster means)")
    has_global_model = False
    fedavg_weighted = False  # uniform means within each cluster (Method.fedavg_weighted)
    per_sample_loss = True  # Method.padding_exact

    def server_init(self, global_state, info):
        state = {"cfl.cluster": torch.zeros(info.num_clients, dtype=torch.long),
                 "cfl.rounds": torch.zeros((), dtype=torch.long)}
        state.update({"cfl.models." + k: global_state[k][None].clone() for k in info.param_names})
        return state

    def broadcast(self, global_state, server_state):
        return {}  # every client gets its cluster's model (download)

    def download(self, server_state, client_id, round_idx):
        c = int(server_state["cfl.cluster"][client_id])
        return {SENT_CFL + k: server_state["cfl.models." + k][c] for k in self.info.param_names}

    def local_start(self, payload, client_state):
        return strip_prefix({k: v for k, v in client_state.items() if k.startswith(SENT_CFL)}, SENT_CFL)

    def after_training(self, trained, payload, client_state, report):
        return as_model_part(trained), {k: v for k, v in client_state.items() if not k.startswith(SENT_CFL)}

    def aggregate(self, server_state, global_state, uploads, reports):
        o, names = self.opt, self.info.param_names
        cluster, models = server_state["cfl.cluster"].clone(), {k: server_state["cfl.models." + k] for k in names}
        ids = [r.client_id for r in reports]
        # each participant's update: its trained model minus its cluster's model
        diffs = {k: torch.cat([(model_part(u)[n] - models[n][cluster[k]]).flatten() for n in names])
                 for k, u in zip(ids, uploads)}
        n = self.info.num_clients
        sim = np.eye(n)
        for i, a in enumerate(ids):
            for b in ids[i + 1:]:
                sim[a, b] = sim[b, a] = float(F.cosine_similarity(diffs[a], diffs[b], dim=0, eps=1e-12))
        rounds = int(server_state["cfl.rounds"])
        groups = []
        for c in range(int(cluster.max()) + 1):
            members = np.flatnonzero(cluster.numpy() == c)
            present = [diffs[k] for k in members if k in diffs]
            mean_norm = float(torch.stack(present).mean(0).norm()) if present else 0.0
            max_norm = max((float(d.norm()) for d in present), default=0.0)
            if (mean_norm < o.eps_1 and max_norm > o.eps_2 and len(members) > o.min_cluster_size
                    and rounds >= o.start_round):
                a, b = bipartition(sim[np.ix_(members, members)])
                groups += [(c, members[a]), (c, members[b])]
            else:
                groups.append((c, members))
        new_cluster = torch.empty_like(cluster)
        new_models = {k: [] for k in names}
        for g, (old, members) in enumerate(groups):
            new_cluster[torch.as_tensor(members, dtype=torch.long)] = g
            present = [k for k in members if k in diffs]
            for k in names:
                model = models[k][old]
                if present:
                    model = model + torch.stack([model_part(uploads[ids.index(j)])[k] - models[k][old]
                                                 for j in present]).mean(0)
                new_models[k].append(model)
        state = {"cfl.cluster": new_cluster, "cfl.rounds": torch.tensor(rounds + 1)}
        state.update({"cfl.models." + k: torch.stack(v) for k, v in new_models.items()})
        return global_state, state


__all__ = ["CFL", "FedConcat", "bipartition", "label_clusters"]


class FedCrossOptions(FedAvgOptions):
    search = {"alpha": [0.9, 0.95, 0.99]}  # the bench's search space (fedskew bench)
    alpha: float = Field(0.99, gt=0, le=1, description="weight of a middleware model's own parameters in its cross "
                                                       "aggregation (the rest: its collaborative model's)")
    strategy: Literal["lowest", "highest", "in_order"] = Field(
        "lowest", description="collaborative model: the least similar (PFLlib's default), the most similar, or the "
                              "one (round mod (K - 1)) + 1 slots further")
    first_stage_rounds: int = Field(0, ge=0, description="rounds before cross aggregation starts, in which every "
                                                         "middleware model is reset to the global model")
    buffers: Literal["pflib", "own"] = Field(
        "pflib", description="buffers (BatchNorm statistics) of a middleware model: pflib: the cross step copies "
                             "those of the lower-indexed model of the pair, the first stage resets parameters only "
                             "(PFLlib's aggregate_parameters_cross and train); own: each keeps its own in the cross "
                             "step, the first stage resets the whole state")


def layer_pair_similarity(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """PFLlib's FedCross similarity of two models given as their state tensors in order: the sum of
    the cosine similarities of consecutive pairs of flattened tensors (weight with bias), the last
    pair (or a last single tensor) counted once more (``servercross.calculate_similarity``)."""
    s, sub_a, sub_b = 0.0, None, None
    for i, (x, y) in enumerate(zip(a, b)):
        x, y = x.reshape(-1).double(), y.reshape(-1).double()
        sub_a, sub_b = (x, y) if i % 2 == 0 else (torch.cat([sub_a, x]), torch.cat([sub_b, y]))
        if i % 2 == 1:
            s += float(F.cosine_similarity(sub_a, sub_b, dim=0))
    return s + float(F.cosine_similarity(sub_a, sub_b, dim=0))


def collaborator(sim: np.ndarray, j: int, strategy: str, round_idx: int) -> int:
    """The model middleware model j is aggregated with (``servercross.cross_aggregation``):
    ``lowest``: the least similar other model (ties: the first, starting from j + 1); ``highest``:
    the most similar (ties: the first, starting from 0; the diagonal is 0 as in PFLlib);
    ``in_order``: j + (round mod (K - 1)) + 1, modulo K."""
    k = len(sim)
    if strategy == "in_order":
        return (j + round_idx % (k - 1) + 1) % k
    if strategy == "highest":
        best = 0
        for p in range(k):
            if sim[j, p] > sim[j, best]:
                best = p
        return best
    low = (j + 1) % k
    for p in range(k):
        if sim[j, p] < sim[j, low] and p != j:
            low = p
    return low


@builtin
class FedCross(Method):
    """FedCross (Hu et al., ICDE 2024): multi-model cross-aggregation. The server
    keeps K middleware models (K = clients per round), each trained by one selected client a round
    (a random assignment, drawn from the seed: PFLlib gives model i to the i-th client of its random
    selection); after training, middleware model j becomes alpha w_j + (1 - alpha) w_c, w_c its
    collaborative model (the least similar by PFLlib's layer-pair cosine, by default); its buffers
    are those of the lower-indexed model of the pair (``buffers=pflib``: PFLlib's
    ``aggregate_parameters_cross`` deep-copies the pair's first model and averages its parameters
    only; ``own``: its own). The global model, which
    the metrics score, is the n_k-weighted mean of the trained middleware models; it only seeds the
    middleware models during ``first_stage_rounds`` and serves the final personalisation pass."""

    @classmethod
    def inert(cls, options, rounds, num_clients, clients_per_round):
        if options.first_stage_rounds >= rounds:
            return (f"first_stage_rounds = {options.first_stage_rounds} is not below rounds = {rounds}: cross "
                    f"aggregation never starts, every middleware model is the global model every round")

    name = "fedcross"
    Options = FedCrossOptions
    source = Source(authors="Hu, Zhou, Yue, Ling, Huang, Li, Liu, Lian, Chen",
                    title="FedCross: Towards Accurate Federated Learning via Multi-Model Cross-Aggregation",
                    venue="ICDE", year=2024, arxiv="2210.08285",
                    implements="Algorithm 1 (middleware models, cross aggregation with a collaborative model)",
                    code="TsingZ0/PFLlib system/flcore/servers/servercross.py, clients/clientcross.py (defaults "
                         "fedcross_alpha 0.99, collaberative_model_select_strategy 1, first_stage_bound 0)")
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss)

    def _k(self) -> int:
        return max(1, min(self.info.clients_per_round, self.info.num_clients))

    def server_init(self, global_state, info):
        k = self._k()
        state = copies(global_state, k, "cross.models.")
        return {**state, "cross.slot": torch.full((info.num_clients,), -1, dtype=torch.long),
                "cross.round": torch.zeros((), dtype=torch.long)}

    def round_start(self, server_state, clients, round_idx):
        slots = numpy_rng(self.info.seed, "fedcross", round_idx).permutation(self._k())[:len(clients)]
        slot = torch.full_like(server_state["cross.slot"], -1)
        slot[torch.tensor(clients, dtype=torch.long)] = torch.from_numpy(slots.astype(np.int64))
        return {**server_state, "cross.slot": slot, "cross.round": torch.tensor(round_idx)}

    def broadcast(self, global_state, server_state):
        # a training round sends each client its middleware model alone (``download``); the final
        # pass (no slots) sends the global model
        return {} if bool((server_state["cross.slot"] >= 0).any()) else as_model_part(global_state)

    def download(self, server_state, client_id, round_idx):
        j = int(server_state["cross.slot"][client_id])
        if j < 0:
            return {}
        return {"cross.model." + n[len("cross.models."):]: v[j] for n, v in server_state.items()
                if n.startswith("cross.models.")}

    def local_start(self, payload, client_state):
        own = strip_prefix(client_state, "cross.model.")
        return own if own else model_part(payload)

    def after_training(self, trained, payload, client_state, report):
        return as_model_part(trained), {k: v for k, v in client_state.items() if not k.startswith("cross.model.")}

    def aggregate(self, server_state, global_state, uploads, reports):
        slot, names = server_state["cross.slot"], list(global_state)
        models = {n: server_state["cross.models." + n].clone() for n in names}
        for u, r in zip(uploads, reports):  # the trained middleware models back in their slots
            for n, v in model_part(u).items():
                models[n][int(slot[r.client_id])] = v.to(models[n].device)
        new = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        k, t = self._k(), int(server_state["cross.round"])
        params, pflib = set(self.info.param_names), self.opt.buffers == "pflib"
        if t < self.opt.first_stage_rounds:  # PFLlib resets the middleware models' parameters only
            models = {n: copies({n: v}, k)[n] if n in params or not pflib else models[n] for n, v in new.items()}
        elif k > 1:
            rows = [[models[n][j] for n in names] for j in range(k)]
            sim = np.zeros((k, k))
            for a in range(k):
                for b in range(a):
                    sim[a, b] = sim[b, a] = layer_pair_similarity(rows[a], rows[b])
            partner = [collaborator(sim, j, self.opt.strategy, t) for j in range(k)]
            alpha = self.opt.alpha
            keep = [min(j, partner[j]) if pflib else j for j in range(k)]  # whose buffers model j takes
            models = {n: torch.stack([alpha * v[j] + (1 - alpha) * v[partner[j]] if n in params else v[keep[j]]
                                      for j in range(k)]) for n, v in models.items()}
        state = {**{"cross.models." + n: v for n, v in models.items()},
                 "cross.slot": torch.full_like(slot, -1), "cross.round": server_state["cross.round"]}
        return new, state
