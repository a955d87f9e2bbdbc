"""FedMR: federated manifold reshaping (Huang et al., TMLR 2023); methods.md section 1.

Local objective L = CE + mu1 * L_intra + mu2 * L_inter, as two reusable components:

* :class:`IntraDecorrelation` (``decorrelation``): intra-class decorrelation of the batch features.
* :class:`PrototypeMargin` (``prototypes``): the inter-class margin against global class
  prototypes, the prototypes' computation on the client and their count-weighted aggregation.

``method=fedmr`` is FedAvg + both; any method takes either piece by configuration
(``method.prototypes.mu2=1e-4``, ``method.decorrelation.mu1=0.01``), as in the paper's Table 8.

Everything here is written with masks over a fixed number of classes (no Python branching on
tensor values), so it runs unchanged under the vectorised executor's ``vmap``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from fedskew.methods.base import ClientReport, FedAvgOptions, reference_tensor
from fedskew.methods.compose import Component, FedAvgWith
from fedskew.streams import numpy_rng


# ---------------------------------------------------------------------------------------------
# Pure functions


def standardised_class_features(z: torch.Tensor, y: torch.Tensor, num_classes: int, eps: float = 1e-8):
    """Per class c: the batch features of class c standardised per dimension with the class's own
    mean and (unbiased) std, sqrt(var + eps). Returns (Zs [C, b, d] with rows of other classes set
    to zero, counts N_c [C])."""
    onehot = F.one_hot(y, num_classes).T.to(z.dtype)  # [C, b]
    counts = onehot.sum(1)
    mean = (onehot @ z) / counts.clamp(min=1)[:, None]
    diff = (z[None] - mean[:, None]) * onehot[:, :, None]
    var = diff.pow(2).sum(1) / (counts - 1).clamp(min=1)[:, None]
    return diff / torch.sqrt(var + eps)[:, None, :], counts


def intra_class_loss(z: torch.Tensor, y: torch.Tensor, num_classes: int, form: str = "code",
                     eps: float = 1e-8) -> torch.Tensor:
    """L_intra. Classes with fewer than two samples in the batch are skipped; if none qualifies
    the result is an exact zero tensor.

    * ``code`` (FedMR authors' code, FedDecorr lineage; the default): G_c = Z_c^T Z_c; term_c =
      mean of the squared off-diagonal entries of G_c; L = sum_c term_c / sum_c N_c.
    * ``paper`` (Eq. 3): M_c = Z_c^T Z_c / (N_c - 1) (the class correlation matrix);
      L = (1/|C_batch|) sum_c ||M_c||_F^2 over qualifying classes. Each unit that varies within a
      class adds 1 (the diagonal), so the form is minimised by dead ReLU units; it is
      d(d-1) sum N_c / (|C_b| (N_c - 1)^2) times the code form's scale (docs/methods.md).
    """
    zs, counts = standardised_class_features(z, y, num_classes, eps)
    qualifies = (counts >= 2).to(z.dtype)
    gram = torch.einsum("cbi,cbj->cij", zs, zs)
    if form == "paper":
        corr = gram / (counts - 1).clamp(min=1)[:, None, None]
        per_class = corr.pow(2).sum((1, 2))
        return (qualifies * per_class).sum() / qualifies.sum().clamp(min=1)
    d = z.shape[1]
    off_diag = gram.pow(2).sum((1, 2)) - torch.diagonal(gram, dim1=1, dim2=2).pow(2).sum(1)
    per_class = off_diag / max(d * (d - 1), 1)
    return (qualifies * per_class).sum() / (qualifies * counts).sum().clamp(min=1)


def inter_class_margin(z: torch.Tensor, y: torch.Tensor, prototypes: torch.Tensor, client_classes: torch.Tensor,
                       inter_classes: str = "all") -> torch.Tensor:
    """L_inter with D(z, y, j) = max(||z - g_y|| - ||z - g_j||, 0) (Euclidean, not squared).

    For each class c_i observed in the batch and each other class j with a prototype (``all``; or
    only the client's own classes, ``local``), the mean of D over the batch samples of class c_i;
    summed and divided by |C_k| (|C_k| - 1), C_k the client's classes (paper normalisation).
    ``prototypes`` [C, d] holds NaN rows for classes with no prototype yet: they are left out, and
    with no prototypes at all (round 0) the term is zero.
    """
    num_classes = prototypes.shape[0]
    valid = ~torch.isnan(prototypes[:, 0])
    protos = torch.nan_to_num(prototypes, nan=0.0)
    dist = torch.linalg.vector_norm(z[:, None, :] - protos[None], dim=-1)  # [b, C]
    own = dist.gather(1, y[:, None])
    margin = torch.relu(own - dist)
    others = F.one_hot(y, num_classes) == 0
    allowed = valid[None, :] & others & valid[y][:, None]
    if inter_classes == "local":
        allowed = allowed & (client_classes[None, :] > 0)
    margin = margin * allowed.to(z.dtype)
    onehot = F.one_hot(y, num_classes).T.to(z.dtype)
    counts = onehot.sum(1).clamp(min=1)
    per_class_mean = (onehot @ margin) / counts[:, None]  # [c_i, j]
    k = (client_classes > 0).sum().to(z.dtype)
    return per_class_mean.sum() / (k * (k - 1)).clamp(min=1)


def class_feature_means(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean feature of each class (zero rows for absent classes) and the class counts."""
    onehot = F.one_hot(y, num_classes).T.to(z.dtype)
    counts = onehot.sum(1)
    return (onehot @ z) / counts.clamp(min=1)[:, None], counts


def aggregate_prototypes(previous: torch.Tensor, means: list[torch.Tensor], counts: list[torch.Tensor]) -> torch.Tensor:
    """g_c = sum_k (n_k^c / sum_k' n_k'^c) zbar_k^c over the uploading clients; a class no
    uploading client holds keeps its previous prototype (NaN if it never had one)."""
    if not means:
        return previous
    m, n = torch.stack(means), torch.stack(counts)  # [K, C, d], [K, C]
    total = n.sum(0)
    new = (n[:, :, None] * m).sum(0) / total.clamp(min=1)[:, None]
    return torch.where((total > 0)[:, None], new, previous)


@lru_cache(maxsize=64)
def sharing_clients(seed: int, num_clients: int, fraction: float) -> frozenset[int]:
    """Clients allowed to upload prototypes (paper Table 5), chosen once from the seed."""
    if fraction >= 1.0:
        return frozenset(range(num_clients))
    count = int(round(fraction * num_clients))
    return frozenset(int(k) for k in numpy_rng(seed, "proto_share").choice(num_clients, count, replace=False))


# ---------------------------------------------------------------------------------------------
# Components


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DecorrelationOptions(_Strict):
    mu1: float = Field(0.01, ge=0, description="weight of L_intra")
    intra_form: Literal["code", "paper"] = Field("code", description="code: the authors' code's form, with which "
                                                                     "the paper's mu1 values train (default); "
                                                                     "paper: Eq. 3, ||M_c||_F^2")


class PrototypeOptions(_Strict):
    mu2: float = Field(1e-4, ge=0, description="weight of L_inter (0: prototypes still computed, no margin)")
    inter_classes: Literal["all", "local"] = "all"
    lite_n: int | None = Field(None, ge=1, description="L_inter on n samples of each batch (Lite)")
    share_fraction: float = Field(1.0, gt=0, le=1, description="fraction of clients that upload prototypes")


class IntraDecorrelation(Component):
    """mu1 * L_intra on the features of every mini-batch. No state, nothing sent."""

    prefix = "decorr."
    Options = DecorrelationOptions

    def loss(self, fwd, params, x, y, payload, client_state):
        z, logits = fwd(x)
        value = intra_class_loss(z, y, logits.shape[-1], self.opt.intra_form)
        return self.opt.mu1 * value, {"fedmr/intra": value.detach()}


class PrototypeMargin(Component):
    """Global class prototypes and mu2 * L_inter.

    Sends down ``proto.g`` [C, d] (NaN rows: no prototype yet): C*d floats. A sharing client
    sends up ``proto.mean`` [C, d] and ``proto.count`` [C]: C*d + C floats. Keeps on the server
    ``proto.g``; on the client ``proto.classes`` (its class counts, for |C_k| and ``local``) and
    ``proto.share`` (whether it may upload).
    """

    prefix = "proto."
    Options = PrototypeOptions

    def server_init(self, global_state, info):
        ref = reference_tensor(global_state)
        return {"proto.g": torch.full((info.num_classes, info.feature_dim), float("nan"),
                                      dtype=ref.dtype, device=ref.device)}

    def client_init(self, client_id, global_state, info):
        share = client_id in sharing_clients(info.seed, info.num_clients, self.opt.share_fraction)
        device = reference_tensor(global_state).device
        return {"proto.classes": info.class_counts[client_id].to(device=device, dtype=torch.float32),
                "proto.share": torch.tensor(float(share), device=device)}

    def broadcast(self, server_state):
        return {"proto.g": server_state["proto.g"]}

    def loss(self, fwd, params, x, y, payload, client_state):
        if self.opt.mu2 == 0:
            return None, {}
        z, _ = fwd(x)
        if self.opt.lite_n is not None:
            # Batches are drawn from a fresh permutation every epoch, so the first n samples of
            # a batch are a uniformly random subset of it (and the same in every executor).
            z, y = z[:self.opt.lite_n], y[:self.opt.lite_n]
        value = inter_class_margin(z, y, payload["proto.g"], client_state["proto.classes"], self.opt.inter_classes)
        return self.opt.mu2 * value, {"fedmr/inter": value.detach()}

    def after_training(self, trained, payload, client_state, report: ClientReport):
        """Eval-mode features of the whole local training set -> class means and counts."""
        if not bool(client_state["proto.share"]):
            return {}, client_state
        z, y = report.local_features(trained)
        means, counts = class_feature_means(z, y, payload["proto.g"].shape[0])
        return {"proto.mean": means, "proto.count": counts}, client_state

    def aggregate(self, server_state, uploads, reports):
        sent = [u for u in uploads if "proto.mean" in u]
        g = aggregate_prototypes(server_state["proto.g"], [u["proto.mean"] for u in sent],
                                 [u["proto.count"] for u in sent])
        return {"proto.g": g}


COMPONENTS: dict[str, type[Component]] = {"decorrelation": IntraDecorrelation, "prototypes": PrototypeMargin}


# ---------------------------------------------------------------------------------------------
# The method


class FedMROptions(FedAvgOptions):
    mu1: float = Field(0.01, ge=0, description="weight of L_intra (paper best: 0.01 FMNIST), in the code form")
    mu2: float = Field(1e-4, ge=0, description="weight of L_inter (0: prototype-free FedMR)")
    intra_form: Literal["code", "paper"] = DecorrelationOptions.model_fields["intra_form"].default
    inter_classes: Literal["all", "local"] = "all"
    lite_n: int | None = Field(None, ge=1)
    proto_share_fraction: float = Field(1.0, gt=0, le=1)


class FedMR(FedAvgWith):
    """FedAvg + IntraDecorrelation(mu1) + PrototypeMargin(mu2)."""

    name = "fedmr"
    Options = FedMROptions

    def parts(self, opt):
        return [IntraDecorrelation(DecorrelationOptions(mu1=opt.mu1, intra_form=opt.intra_form)),
                PrototypeMargin(PrototypeOptions(mu2=opt.mu2, inter_classes=opt.inter_classes, lite_n=opt.lite_n,
                                                 share_fraction=opt.proto_share_fraction))]

__all__ = ["COMPONENTS", "FedMR", "IntraDecorrelation", "PrototypeMargin", "aggregate_prototypes",
           "class_feature_means", "inter_class_margin", "intra_class_loss"]
