"""Classifier-side methods for label skew: CCVR (server-side calibration of the head on virtual
representations), FedNH (a head of fixed-norm class prototypes, uniform at first, into which
the clients' class semantics are smoothly injected) and FedPAC (feature alignment to global
prototypes, and each client's head combined from the others' by a quadratic program); pFedFDA
(the head as a Gaussian generative classifier of interpolated local and global feature statistics).

Both read the features z the head takes (``classifier.*``, a linear layer) and leave the body to
FedAvg's averaging.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import (
    HEAD,
    FedAvgOptions,
    Method,
    Source,
    as_model_part,
    builtin,
    copies,
    head_names,
    model_part,
    reference_tensor,
    strip_prefix,
    weighted_mean,
)
from fedskew.algorithms.tensors import aggregate_prototypes, class_feature_means
from fedskew.streams import torch_seed

# ---------------------------------------------------------------------------------------------
# CCVR


def class_statistics(z: torch.Tensor, y: torch.Tensor, num_classes: int):
    """Per class c: the mean mu_c [C, d], the unbiased covariance Sigma_c [C, d, d] (zero for a
    class with fewer than two samples) and the count N_c [C] of the features z."""
    means, counts = class_feature_means(z, y, num_classes)
    onehot = F.one_hot(y, num_classes).T.to(z.dtype)  # [C, n]
    diff = (z[None] - means[:, None]) * onehot[:, :, None]  # [C, n, d]
    cov = torch.einsum("cni,cnj->cij", diff, diff) / (counts - 1).clamp(min=1)[:, None, None]
    return means, cov * (counts >= 2).to(z.dtype)[:, None, None], counts


def pooled_statistics(means: torch.Tensor, covs: torch.Tensor, counts: torch.Tensor):
    """CCVR Eq. 3-4: the global mean and covariance of each class from the clients' [K, C, ...]:
    mu_c = sum_k N_kc/N_c mu_kc; Sigma_c = sum_k (N_kc - 1)/(N_c - 1) Sigma_kc
    + sum_k N_kc/(N_c - 1) mu_kc mu_kc^T - N_c/(N_c - 1) mu_c mu_c^T. Returns (mu [C, d],
    Sigma [C, d, d], N [C]); a class with N_c < 2 has no covariance (zeros)."""
    total = counts.sum(0)  # [C]
    mu = (counts[:, :, None] * means).sum(0) / total.clamp(min=1)[:, None]
    denom = (total - 1).clamp(min=1)[:, None, None]
    outer = torch.einsum("kci,kcj->kcij", means, means)
    sigma = (((counts - 1).clamp(min=0)[:, :, None, None] * covs).sum(0)
             + (counts[:, :, None, None] * outer).sum(0)) / denom \
        - total[:, None, None] / denom * torch.einsum("ci,cj->cij", mu, mu)
    return mu, sigma * (total >= 2).to(mu.dtype)[:, None, None], total


def sample_virtual(mu: torch.Tensor, sigma: torch.Tensor, total: torch.Tensor, per_class: int,
                   generator: torch.Generator):
    """``per_class`` draws from N(mu_c, Sigma_c) for every class with N_c >= 2: mu_c + eps Sigma_c^(1/2),
    eps standard normal, with the symmetric PSD square root (continuous in Sigma_c, unlike a
    Cholesky or eigenvector factor of a rank-deficient covariance; negative rounding eigenvalues
    clamped to 0): (z [m, d], y [m])."""
    zs, ys = [], []
    for c in torch.nonzero(total >= 2).flatten().tolist():
        evals, evecs = torch.linalg.eigh(sigma[c].double())
        root = (evecs * evals.clamp(min=0).sqrt()) @ evecs.T  # symmetric: root @ root = Sigma_c
        eps = torch.randn(per_class, mu.shape[1], generator=generator, dtype=torch.float64)
        zs.append((mu[c].double() + eps @ root.T).to(mu.dtype))
        ys.append(torch.full((per_class,), c, dtype=torch.long))
    if not zs:
        return mu.new_zeros(0, mu.shape[1]), torch.zeros(0, dtype=torch.long)
    return torch.cat(zs), torch.cat(ys)


class CCVROptions(FedAvgOptions):
    search = {'calib_lr': [0.001, 0.01, 0.1]}  # the bench's search space (fedskew bench)
    virtual_per_class: int = Field(200, ge=1, description="virtual representations drawn per class "
                                                          "(FL-bench's sample_per_class)")
    calib_lr: float = Field(0.01, gt=0, description="SGD learning rate of the head's calibration")
    calib_epochs: int = Field(1, ge=1, description="epochs over the virtual representations")
    feedback: bool = Field(False, description="send the calibrated head down (false: calibration is "
                                              "post-hoc, the clients keep training the averaged head)")


@builtin
class CCVR(Method):
    """CCVR (Luo et al., NeurIPS 2021): FedAvg, then classifier calibration with virtual
    representations. Each selected client also uploads, for each class, the mean, covariance and
    count of the features of the model it received (Eq. 2); the server pools them into per-class
    Gaussians (Eq. 3-4), draws ``virtual_per_class`` features per class and retrains the averaged
    head on them with SGD (``calib_epochs`` epochs, batch B, shuffled), starting from the averaged
    head (Section 4.2). The calibrated model is the global model scored every round; as the paper
    is post-hoc, the averaged head (kept on the server) is what clients receive unless
    ``feedback``. Differences from the paper (one calibration after training, statistics of the
    final global model from all clients): here every round, from the round's selected clients, with
    the features of the model they received (one round older than the averaged body).

    Down: FedAvg's. Up: FedAvg's + C*d means + C*d^2 covariances + C counts."""

    name = "ccvr"
    Options = CCVROptions
    source = Source(
        authors="Luo et al.",
        title="No Fear of Heterogeneity: Classifier Calibration for Federated Learning with Non-IID Data",
        venue="NeurIPS",
        year=2021,
        arxiv="2106.05001",
        implements="Algorithm 1 (feature statistics, virtual representations, classifier calibration)",
        code="no official code; the paper's Algorithm 1")
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss)
    requires_classifier = "linear"

    def server_init(self, global_state, info):
        state = {"ccvr.raw." + k: v.clone() for k, v in global_state.items() if k.startswith(HEAD)}
        state["ccvr.round"] = torch.zeros((), device=reference_tensor(global_state).device)
        return state

    def broadcast(self, global_state, server_state):
        if self.opt.feedback:
            return as_model_part(global_state)
        raw = strip_prefix(server_state, "ccvr.raw.")
        return as_model_part({**global_state, **raw})

    def after_training(self, trained, payload, client_state, report):
        z, y = report.local_features(model_part(payload))
        means, covs, counts = class_statistics(z, y, self.info.num_classes)
        return {**as_model_part(trained), "ccvr.mean": means, "ccvr.cov": covs, "ccvr.count": counts}, client_state

    def calibrate(self, head: dict, z: torch.Tensor, y: torch.Tensor, round_idx: int) -> dict:
        """SGD on the linear head ``head`` (weight, optional bias) with CE on (z, y)."""
        params = {k: v.detach().clone().requires_grad_(True) for k, v in head.items()}
        gen = torch.Generator().manual_seed(torch_seed(self.info.seed, "ccvr", round_idx))
        b = self.info.batch_size
        for _ in range(self.opt.calib_epochs):
            order = torch.randperm(len(y), generator=gen).to(z.device)
            for i in range(0, len(y), b):
                rows = order[i:i + b]
                logits = F.linear(z[rows], params[HEAD + "weight"], params.get(HEAD + "bias"))
                grads = torch.autograd.grad(F.cross_entropy(logits, y[rows]), list(params.values()))
                with torch.no_grad():
                    for p, g in zip(params.values(), grads):
                        p -= self.opt.calib_lr * g
        return {k: v.detach() for k, v in params.items()}

    def aggregate(self, server_state, global_state, uploads, reports):
        new = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        round_idx = int(server_state["ccvr.round"])
        mu, sigma, total = pooled_statistics(torch.stack([u["ccvr.mean"] for u in uploads]),
                                             torch.stack([u["ccvr.cov"] for u in uploads]),
                                             torch.stack([u["ccvr.count"] for u in uploads]))
        gen = torch.Generator().manual_seed(torch_seed(self.info.seed, "ccvr_virtual", round_idx))
        z, y = sample_virtual(mu.cpu(), sigma.cpu(), total.cpu(), self.opt.virtual_per_class, gen)
        raw = {k: v for k, v in new.items() if k.startswith(HEAD)}
        calibrated = self.calibrate(raw, z.to(mu.device), y.to(mu.device), round_idx) if len(y) else raw
        state = {**{"ccvr.raw." + k: v for k, v in raw.items()}, "ccvr.round": server_state["ccvr.round"] + 1}
        return {**new, **calibrated}, state


# ---------------------------------------------------------------------------------------------
# FedNH


class FedNHOptions(FedAvgOptions):
    search = {'scale': [10.0, 30.0], 'smoothing': [0.7, 0.9]}  # the bench's search space (fedskew bench)
    weighting: Literal["samples", "batches", "uniform"] = Field(
        "uniform", description="body averaging (official code: uniform over participants)")
    scale: float = Field(30.0, gt=0, description="s in logits = s cos(z, p_c) (official code's fixed scaling)")
    smoothing: float = Field(0.9, ge=0, le=1, description="rho of the prototype update p <- rho p + (1 - rho) p_new")


def cosine_logits(z: torch.Tensor, prototypes: torch.Tensor, scale: float) -> torch.Tensor:
    """s * <z/||z||, p_c/||p_c||> for every class c."""
    return scale * F.normalize(z, dim=-1) @ F.normalize(prototypes, dim=-1).T


@builtin
class FedNH(Method):
    """FedNH (Dai et al., AAAI 2023). The head's rows are class prototypes p_c, fixed during local
    training; at the start they are orthonormal random vectors (uniformity; the official code's
    ``orthogonal`` initialisation, drawn from the seed). Local loss: CE of s cos(z, p_c) (Eq. 3,
    normalised features and prototypes, fixed scale s = 30). After training each client uploads,
    per class it holds, the normalised mean of its normalised eval-mode features times its count;
    the server averages these over the clients by count, normalises, and injects them smoothly:
    p_c <- normalise(rho p_c + (1 - rho) normalise(mean_c)) (Eq. 6, rho = 0.9); a class no
    participant holds keeps its prototype. The body is averaged (uniformly over participants, as the
    official code). The global model's head holds the unit prototypes with no bias, so its argmax
    is the cosine classifier's.

    Down: the model (head = prototypes). Up: the body + C*d prototype sums + C counts."""

    name = "fednh"
    Options = FedNHOptions
    source = Source(
        authors="Dai et al.",
        title="Tackling Data Heterogeneity in Federated Learning with Class Prototypes",
        venue="AAAI",
        year=2023,
        arxiv="2212.02758",
        implements="Eq. 5-6 (prototype initialisation and smoothed aggregation) and Algorithm 1",
        code="Yutong-Dai/FedNH")
    requires_classifier = "linear"
    model_defaults = {"classifier_bias": False}
    per_sample_loss = True  # Method.padding_exact
    model_requires = {HEAD + "bias": (False, "model.classifier_bias = false: the head is the prototypes alone")}

    def server_init(self, global_state, info):
        w = global_state[HEAD + "weight"]
        gen = torch.Generator().manual_seed(torch_seed(info.seed, "fednh"))
        protos = torch.nn.init.orthogonal_(torch.rand(w.shape, generator=gen, dtype=torch.float64), generator=gen)
        return {"fednh.p": F.normalize(protos, dim=1).to(w)}

    def broadcast(self, global_state, server_state):
        return as_model_part({**global_state, HEAD + "weight": server_state["fednh.p"]})

    def trained_params(self, stage):
        return frozenset(k for k in self.info.param_names if not k.startswith(HEAD))

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, _ = fwd(x)
        return fwd.cross_entropy(cosine_logits(z, params[HEAD + "weight"], self.opt.scale), y), {}

    def after_training(self, trained, payload, client_state, report):
        z, y = report.local_features(trained)
        means, counts = class_feature_means(F.normalize(z, dim=-1), y, self.info.num_classes)
        body = {k: v for k, v in trained.items() if not k.startswith(HEAD)}
        return {**as_model_part(body), "fednh.sum": F.normalize(means, dim=-1) * counts[:, None],
                "fednh.count": counts}, client_state

    def aggregate(self, server_state, global_state, uploads, reports):
        body = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        total = torch.stack([u["fednh.count"] for u in uploads]).sum(0)
        mean = torch.stack([u["fednh.sum"] for u in uploads]).sum(0) / total.clamp(min=1e-12)[:, None]
        rho, p = self.opt.smoothing, server_state["fednh.p"]
        new = F.normalize(rho * p + (1 - rho) * F.normalize(mean, dim=-1), dim=-1)
        new = torch.where((total > 0)[:, None], new, p)
        return {**global_state, **body, HEAD + "weight": new}, {"fednh.p": new}


# ---------------------------------------------------------------------------------------------
# FedPAC


class FedPACOptions(FedAvgOptions):
    search = {'lam': [0.1, 1.0, 10.0]}  # the bench's search space (fedskew bench)
    lam: float = Field(1.0, ge=0, description="weight of the feature-alignment MSE (official default 1.0)")
    head_lr_scale: float = Field(10.0, gt=0, description="head epoch's lr as a multiple of the local lr "
                                                         "(official: 0.1 with a body lr of 0.01)")
    collaborate: bool = Field(True, description="combine each selected client's head from the round's heads "
                                                "(official agg_g)")


def pac_statistics(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FedPAC's per-client feature statistics (official ``statistics_extraction``): with p_k the
    client's label distribution and mu_k its class-k mean feature,
    v = [sum_k p_k tr(F_k^T F_k / n_k) - sum_k p_k^2 ||mu_k||^2] / n and h = [p_k mu_k]_k [C, d]."""
    means, counts = class_feature_means(z, y, num_classes)
    n = len(y)
    p = counts / n
    onehot = F.one_hot(y, num_classes).T.to(z.dtype)
    second = (onehot @ z.pow(2).sum(1)) / counts.clamp(min=1)  # tr(F_k^T F_k) / n_k
    v = ((p * second).sum() - (p.pow(2) * means.pow(2).sum(1)).sum()) / n
    return v, p[:, None] * means


def head_combination(v: torch.Tensor, h: torch.Tensor, i: int, eps: float = 1e-3) -> torch.Tensor | None:
    """FedPAC Eq. 10-11 for client i of the round's m clients (official ``get_head_agg_weight``):
    minimise a^T (diag(v) + D) a over the simplex, D_jl = sum_k <h_i,k - h_j,k, h_i,k - h_l,k>; a
    non-PSD matrix is rebuilt from its eigenvalues >= 0.01; weights under ``eps`` are zeroed (the
    caller renormalises). None when no solution (the client keeps its head)."""
    from scipy.optimize import minimize

    diff = (h[i][None] - h).flatten(1).double()  # [m, C*d]
    P = torch.diag(v.double()) + diff @ diff.T
    evals, evecs = torch.linalg.eigh(P)
    if (evals < 0).any():
        keep = evals >= 0.01
        P = (evecs[:, keep] * evals[keep]) @ evecs[:, keep].T
    Pn = P.numpy()
    m = len(v)
    res = minimize(lambda a: a @ Pn @ a, np.full(m, 1.0 / m), jac=lambda a: 2 * Pn @ a, method="SLSQP",
                   bounds=[(0.0, 1.0)] * m, constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0}],
                   options={"ftol": 1e-12, "maxiter": 500})
    if not res.success:
        return None
    a = torch.from_numpy(res.x).clamp(min=0)
    return torch.where(a > eps, a, torch.zeros_like(a))


@builtin
class FedPAC(Method):
    """FedPAC (Xu et al., ICLR 2023; reference JianXu95/FedPAC). Each client keeps its own head.
    Before training it extracts its feature statistics (v, h; :func:`pac_statistics`) and local
    class prototypes with the received body and its head; it trains the head for one epoch (body
    frozen, lr x ``head_lr_scale``), then the body for E epochs (head frozen) on
    CE + lam * MSE(z, c_y) (Eq. 8), c_y the global prototype of the label (the client's own
    pre-training prototype where the global one is missing; no alignment before any global
    prototype exists, as the reference's round 0). It uploads the model, its class prototypes
    after training, label counts and (v, h). The server averages the models by data size (the
    global model, averaged head included, as the reference's global model), the prototypes by
    count, and for each selected client solves the head-combination QP (:func:`head_combination`)
    over the round's heads; the combined head reaches the client at its next selection (a
    per-client download: the same floats as the reference's immediate update). Personalised model:
    the trained body with the client's trained head. No global model is scored (``global/*`` none):
    the server's average of personalised heads is no classifier anyone trains, and the paper
    reports personalised accuracy only (the averaged body is what clients receive).

    Down: the body + C*d prototypes (+ the client's combined head when it has one). Up: the model +
    C*d + C + 1 + C*d. Keeps its head and pre-training prototypes; server: a head per client."""

    name = "fedpac"
    Options = FedPACOptions
    source = Source(
        authors="Xu, Tong, Huang",
        title="Personalized Federated Learning with Feature Alignment and Classifier Collaboration",
        venue="ICLR",
        year=2023,
        arxiv="2306.11867",
        implements="the feature alignment and the classifier combination weights (the paper's Section 4)",
        code="JianXu95/FedPAC")
    requires_classifier = "linear"
    has_global_model = False
    personal_first = True
    per_sample_loss = True  # Method.padding_exact

    def server_init(self, global_state, info):
        ref = reference_tensor(global_state)
        state = copies({k: v for k, v in global_state.items() if k.startswith(HEAD)}, info.num_clients, "pac.heads.")
        state["pac.has_head"] = torch.zeros(info.num_clients, dtype=ref.dtype, device=ref.device)
        state["pac.g"] = torch.full((info.num_classes, info.feature_dim), float("nan"), dtype=ref.dtype,
                                    device=ref.device)
        return state

    def client_init(self, client_id, global_state, info):
        ref = reference_tensor(global_state)
        state = {"pac.head." + k: v.clone() for k, v in global_state.items() if k.startswith(HEAD)}
        state["pac.local"] = torch.zeros(info.num_classes, info.feature_dim, dtype=ref.dtype, device=ref.device)
        state["pac.v"] = torch.zeros((), dtype=ref.dtype, device=ref.device)
        state["pac.h"] = torch.zeros(info.num_classes, info.feature_dim, dtype=ref.dtype, device=ref.device)
        return state

    def broadcast(self, global_state, server_state):
        return {**as_model_part({k: v for k, v in global_state.items() if not k.startswith(HEAD)}),
                "pac.g": server_state["pac.g"]}

    def download(self, server_state, client_id, round_idx):
        if not bool(server_state["pac.has_head"][client_id]):
            return {}
        return {"pac.new." + k[len("pac.heads."):]: v[client_id] for k, v in server_state.items()
                if k.startswith("pac.heads.")}

    def prepare(self, payload, client_state, data):
        head = strip_prefix(client_state, "pac.new.") or strip_prefix(client_state, "pac.head.")
        state = {k: v for k, v in client_state.items() if not k.startswith("pac.new.")}
        state.update({"pac.head." + k: v for k, v in head.items()})
        with torch.no_grad():
            z, _ = self.info.model_call({**model_part(payload), **head}, data.x)
        v, h = pac_statistics(z, data.y, self.info.num_classes)
        means, _ = class_feature_means(z, data.y, self.info.num_classes)
        return {**state, "pac.v": v, "pac.h": h, "pac.local": means}

    def local_start(self, payload, client_state):
        return {**model_part(payload), **strip_prefix(client_state, "pac.head.")}

    def split_steps(self, total_steps, lr):
        epoch = max(1, total_steps // max(self.info.local_epochs, 1))
        return total_steps, epoch, lr * self.opt.head_lr_scale

    def trained_params(self, stage):
        head = head_names(self.info)
        return head if stage == "personal" else frozenset(self.info.param_names) - head

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, logits = fwd(x)
        ce = fwd.cross_entropy(logits, y)
        g = payload["pac.g"]
        known = ~torch.isnan(g[:, 0])
        target = torch.where(known[:, None], torch.nan_to_num(g), client_state["pac.local"])[y]
        active = known.any().to(z.dtype)  # no global prototype yet: no alignment (reference round 0)
        mse = fwd.mean((z - target).pow(2))
        return ce + self.opt.lam * active * mse, {"fedpac/align": mse.detach()}

    def after_personal(self, personal, payload, client_state, report):
        return {**client_state, **{"pac.head." + k: personal[k] for k in head_names(self.info)}}

    def after_training(self, trained, payload, client_state, report):
        z, y = report.local_features(trained)
        means, counts = class_feature_means(z, y, self.info.num_classes)
        upload = {**as_model_part(trained), "pac.mean": means, "pac.count": counts, "pac.v": client_state["pac.v"],
                  "pac.h": client_state["pac.h"]}
        state = {k: v for k, v in client_state.items() if not k.startswith("pac.new.")}
        return upload, {**state, **{"pac.head." + k: trained[k] for k in head_names(self.info)}}

    def aggregate(self, server_state, global_state, uploads, reports):
        new = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        g = aggregate_prototypes(server_state["pac.g"], [u["pac.mean"] for u in uploads],
                                 [u["pac.count"] for u in uploads])
        state = {**server_state, "pac.g": g}
        if self.opt.collaborate:
            v = torch.stack([u["pac.v"] for u in uploads]).cpu()
            h = torch.stack([u["pac.h"] for u in uploads]).cpu()
            heads = {k: torch.stack([model_part(u)[k] for u in uploads]) for k in head_names(self.info)}
            stored = {k: server_state["pac.heads." + k].clone() for k in head_names(self.info)}
            has = server_state["pac.has_head"].clone()
            for i, r in enumerate(reports):
                a = head_combination(v, h, i)
                if a is None or a.sum() == 0:
                    combined = {k: heads[k][i] for k in heads}
                else:
                    w = (a / a.sum()).to(heads[next(iter(heads))])
                    combined = {k: (w.view(-1, *([1] * (t.dim() - 1))) * t).sum(0) for k, t in heads.items()}
                for k in stored:
                    stored[k][r.client_id] = combined[k]
                has[r.client_id] = 1
            state.update({"pac.heads." + k: t for k, t in stored.items()})
            state["pac.has_head"] = has
        return new, state


__all__ = [
    "CCVR",
    "FedNH",
    "FedPAC",
    "head_combination",
    "pac_statistics",
    "class_statistics",
    "cosine_logits",
    "pooled_statistics",
    "sample_virtual",
]


# ---------------------------------------------------------------------------------------------
# pFedFDA

FDA_EPS = 1e-4  # the official client's eps: priors, covariance shrinkage and the MLE's diagonal


class PFedFDAOptions(FedAvgOptions):
    search = {"beta": ["two", "single"]}  # the bench's search space (fedskew bench)
    beta: Literal["two", "single", "local"] = Field(
        "two", description="interpolation of local and global statistics: one beta for the means and one for the "
                           "covariance (the official default), one for both, or the local statistics alone")
    cv_folds: int = Field(2, ge=2, description="stratified folds on which beta is fitted")
    class_means: Literal["present", "min_samples"] = Field(
        "present", description="local class means: present: every class the client holds keeps its own mean (the "
                               "camera-ready code's test reads the client's total count); min_samples: a class with at "
                               "most cv_folds samples takes the global mean (FL-bench's port; the official "
                               "evaluation's rule for the means, not for its covariance)")


def lda_head(means: torch.Tensor, cov: torch.Tensor, priors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The linear head of the Gaussian generative classifier with class means ``means`` [C, d], one
    shared covariance and class priors (pFedFDA, Mclaughlin et al., NeurIPS 2024, Sec. 4; the
    official ``set_lda_weights``): Sigma' = (1 - eps) Sigma + eps tr(Sigma) / d I, W = (Sigma'^-1
    mu^T)^T, b_c = -mu_c . W_c / 2 + log pi_c. The official code solves by least squares
    (``lstsq``); Sigma' is positive definite here (a scatter plus eps + I, or a mean of such), so
    the exact solve (LU) gives the same W to round-off, and, unlike torch's CPU ``lstsq``, whose
    result moved by 1e-14 from one call to the next on the same inputs, the same bits every time
    (two identical pFedFDA runs had betas 1e-13 apart)."""
    d = cov.shape[0]
    cov = (1 - FDA_EPS) * cov + FDA_EPS * torch.trace(cov) / d * torch.eye(d, dtype=cov.dtype, device=cov.device)
    w = torch.linalg.solve(cov, means.T).T
    return w, -0.5 * (means * w).sum(1) + torch.log(priors.to(means.device))  # (priors: the host's counts)


def gaussian_mle(z: torch.Tensor, y: torch.Tensor, global_means: torch.Tensor, min_samples: int,
                 per_class: bool = False):
    """The official ``compute_mle_statistics`` with its covariance: each class's mean, the scatter
    of the features around their class means, Sigma = scatter / (n - 1) + eps + I (an identity
    added, as the official code does; it is positive definite, so the official
    ``cov_nearest(..., 'clipped')`` leaves it unchanged). A class keeps the global mean when the
    test ``> min_samples`` fails: the camera-ready code tests ``len(labels == y)``, the client's
    total count (every present class keeps its own mean); ``per_class`` tests the class's own
    count (FL-bench's port; the official ``evaluate_personalized`` chooses its means so). The scatter
    is taken around the means chosen here, so a class that takes the global mean is centred on it;
    the official evaluation centres every class on its own mean, so its covariance differs there."""
    means = global_means.clone()
    centered = []
    for c in torch.unique(y).tolist():
        rows = z[y == c]
        if (len(rows) if per_class else len(y)) > min_samples:
            means[c] = rows.mean(0)
        centered.append(rows - means[c])
    centered = torch.cat(centered)
    d = z.shape[1]
    return means, centered.T @ centered / (len(z) - 1) + FDA_EPS + torch.eye(d, dtype=z.dtype)


@builtin
class PFedFDA(Method):
    """pFedFDA (McLaughlin, Su, NeurIPS 2024), as the authors' code runs it
    (cj-mclaughlin/pFedFDA ``client_fedfda.py``, ``server_fedfda.py``): the head is the Gaussian
    generative classifier of shared-covariance class distributions (``lda_head``). A client trains
    the body for its E epochs under the head of the global statistics and its own priors (frozen),
    then fits its local statistics (``gaussian_mle``) on its features, interpolates them with the
    global ones, mu = beta_0 mu_local + (1 - beta_0) mu_global, Sigma likewise with beta_1, beta fitted
    by L-BFGS on a stratified cross-validation of its features, and uploads the body and the
    interpolated statistics; the server averages both (n_k weights). The personalised model is the
    body with the head of the client's interpolated statistics; the global model the body with the
    head of the global statistics and uniform priors."""

    name = "pfedfda"
    Options = PFedFDAOptions
    source = Source(authors="McLaughlin, Su",
                    title="Personalized Federated Learning via Feature Distribution Adaptation", venue="NeurIPS",
                    year=2024, arxiv="2411.00329",
                    implements="the generative head, beta by cross-validation, interpolated statistics (Sec. 4)",
                    code="cj-mclaughlin/pFedFDA clients/client_fedfda.py, servers/server_fedfda.py (eps 1e-4, 2 folds, "
                         "L-BFGS 10 iterations, gtol 1e-3); FL-bench's pfedfda port")
    requires_classifier = "linear"
    model_requires = {"classifier.bias": (True, "a classifier with a bias (the generative head's log-prior)")}
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss, the head frozen)

    def _priors(self, client_id: int) -> torch.Tensor:
        counts = self.info.class_counts[client_id].double()
        p = counts / counts.sum().clamp(min=1) + FDA_EPS
        return p / p.sum()

    def server_init(self, global_state, info):
        gen = torch.Generator().manual_seed(torch_seed(info.seed, "pfedfda"))
        d, dtype = info.feature_dim, global_state["classifier.weight"].dtype
        return {"fda.means": torch.rand(info.num_classes, d, generator=gen).to(dtype),
                "fda.cov": torch.eye(d, dtype=dtype)}

    def client_init(self, client_id, global_state, info):
        # the personalised head exists from the start (all zero until the client's first training,
        # ``fda.fitted`` 0), so trained and never-trained clients stack in one final pass
        return {"fda.beta": torch.full((2,), 0.5, dtype=torch.float64),
                "fda.personal.weight": torch.zeros_like(global_state["classifier.weight"]),
                "fda.personal.bias": torch.zeros_like(global_state["classifier.bias"]),
                "fda.fitted": torch.zeros((), dtype=global_state["classifier.weight"].dtype)}

    def broadcast(self, global_state, server_state):
        return {**as_model_part(global_state), **server_state}

    def prepare(self, payload, client_state, data):
        w, b = lda_head(payload["fda.means"].double(), payload["fda.cov"].double(), self._priors(data.client_id))
        like = payload["model.classifier.weight"]
        return {**client_state, "fda.head.weight": w.to(like), "fda.head.bias": b.to(like)}

    def local_start(self, payload, client_state):
        return {**model_part(payload), "classifier.weight": client_state["fda.head.weight"],
                "classifier.bias": client_state["fda.head.bias"]}

    def trained_params(self, stage):
        return frozenset(k for k in self.info.param_names if not k.startswith(HEAD))

    def solve_beta(self, z, y, gm, gc, priors, previous):
        """beta by the official ``solve_beta``: classes with fewer samples than folds dropped, a
        stratified split (seed 0), per fold the local statistics of its training part, then L-BFGS
        (10 iterations, gradient tolerance 1e-3, strong Wolfe line search; the official code calls
        torchmin's) on the summed cross-entropy of the held-out parts under the interpolated
        heads, beta clipped to [0, 1] inside the loss; a split that fails gives beta = 0, an
        optimisation that fails keeps ``previous``."""
        from sklearn.model_selection import StratifiedKFold

        if self.opt.beta == "local":
            return torch.ones(2, dtype=torch.float64)
        folds = self.opt.cv_folds
        values, counts = torch.unique(y, return_counts=True)
        keep = torch.isin(y, values[counts >= folds])
        z, y = z[keep], y[keep]
        try:
            split = list(StratifiedKFold(n_splits=folds, random_state=0, shuffle=True).split(z.numpy(), y.numpy()))
        except ValueError:
            return torch.zeros(2, dtype=torch.float64)
        per_class = self.opt.class_means == "min_samples"
        parts = [(gaussian_mle(z[tr], y[tr], gm, folds, per_class), z[te], y[te]) for tr, te in split]

        def loss(a):
            a = a.clip(0, 1)
            a_cov = a[0] if self.opt.beta == "single" else a[-1]
            return sum(F.cross_entropy(zt @ w.T + b, yt) for (mu, cov), zt, yt in parts
                       for w, b in [lda_head(a[0] * mu + (1 - a[0]) * gm, a_cov * cov + (1 - a_cov) * gc, priors)])

        x = torch.full((1 if self.opt.beta == "single" else 2,), 0.5, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([x], lr=1, max_iter=10, tolerance_grad=1e-3, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            value = loss(x)
            value.backward()
            return value

        try:
            opt.step(closure)
        except RuntimeError:
            return previous
        x = x.detach().clip(0, 1)
        return x.repeat(2) if len(x) == 1 else x

    def after_training(self, trained, payload, client_state, report):
        z, y = report.local_features(trained)
        z, y = z.double().cpu(), y.cpu()
        gm, gc = payload["fda.means"].double().cpu(), payload["fda.cov"].double().cpu()
        priors = self._priors(report.client_id)
        beta = self.solve_beta(z, y, gm, gc, priors, client_state["fda.beta"])
        mu, cov = gaussian_mle(z, y, gm, self.opt.cv_folds, self.opt.class_means == "min_samples")
        means, covariance = beta[0] * mu + (1 - beta[0]) * gm, beta[1] * cov + (1 - beta[1]) * gc
        w, b = lda_head(means, covariance, priors)
        like = trained["classifier.weight"]
        upload = {**as_model_part(trained), "fda.means": means.to(like), "fda.cov": covariance.to(like)}
        return upload, {"fda.beta": beta, "fda.personal.weight": w.to(like), "fda.personal.bias": b.to(like),
                        "fda.fitted": torch.ones_like(client_state["fda.fitted"])}

    def personal_state(self, trained, client_state):
        if not float(client_state["fda.fitted"]):
            return trained
        return {**trained, "classifier.weight": client_state["fda.personal.weight"],
                "classifier.bias": client_state["fda.personal.bias"]}

    def aggregate(self, server_state, global_state, uploads, reports):
        weights = self.client_weights(reports)
        new = weighted_mean([model_part(u) for u in uploads], weights)
        stats = weighted_mean([{k: u[k] for k in ("fda.means", "fda.cov")} for u in uploads], weights)
        means, cov = stats["fda.means"].double(), stats["fda.cov"].double()
        uniform = torch.full((self.info.num_classes,), 1.0 / self.info.num_classes, dtype=torch.float64)
        w, b = lda_head(means, cov, uniform)
        like = new["classifier.weight"]
        new.update({"classifier.weight": w.to(like), "classifier.bias": b.to(like)})
        return new, {"fda.means": means.to(like), "fda.cov": cov.to(like)}
