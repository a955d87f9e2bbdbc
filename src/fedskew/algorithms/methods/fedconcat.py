"""fedconcat: FedConcat (Diao, Li and He, AAAI 2024), Algorithm 1 as the authors' code runs it: clients clustered
by k-means on their label distributions (:func:`label_clusters`); rounds < ``encoder_rounds``: each client
trains its cluster's model (branch c, classifier block W_c, bias b_c; logits W_c z_c + b_c, cross-entropy, E
epochs) and the server averages each cluster over its members by samples; then the branches are frozen and each
selected client takes ``classifier_steps`` SGD steps of cross-entropy on the concatenated classifier (features
from the received encoders in eval mode), which the server averages with equal weights (the authors: "we move 3
steps for all clients, so this average should be unweighted"). (Family ``clustered``; the class's docstring has
the details.)"""

from __future__ import annotations

import math
import warnings
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import (
    Method,
    Source,
    StrictOptions,
    as_model_part,
    builtin,
    model_part,
    strip_prefix,
    weighted_mean,
)
from fedskew.models.nets import Branches, SkewNet
from fedskew.streams import stream_key

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
    family = "clustered"

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
