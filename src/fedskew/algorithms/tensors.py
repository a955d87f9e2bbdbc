"""Pure tensor functions that methods of several families build on: class statistics and
prototypes (FedMR, FedProto, FedNH, ETF+GMV, CCVR), the losses of the attachable components
(FedMR's intra/inter terms, restricted softmax scales, FedPHP's transfer, FedDecorr), MMD, the
balanced softmax. No state, no options, no model: every family may import this module, and no
family imports another (tests/test_api.py checks it).

Everything here is written with masks over a fixed number of classes where it runs inside local
training (no Python branching on tensor values), so it runs unchanged under ``vmap``.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from fedskew.streams import numpy_rng


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


def rs_scales(class_counts: torch.Tensor, alpha: float, form: str = "hard") -> torch.Tensor:
    """Per-class logit scales s_c of one client (FedRS; MAP paper Eq. 8).

    hard (MAP paper): s_c = 1 for a class with at least one local training sample, alpha otherwise.
    soft (FedRS reference code): s_c = alpha + (1 - alpha) * n_c / max_c' n_c'.
    (The MAP reference code compares the class *fraction* with 1, which gives alpha to every
    class; not reproduced.)"""
    counts = class_counts.to(torch.float32)
    if form == "hard":
        return torch.where(counts >= 1, torch.ones_like(counts), torch.full_like(counts, alpha))
    return alpha + (1 - alpha) * counts / counts.max().clamp(min=1)


def hpm_momentum(visits: torch.Tensor, expected_visits: float, mu_max: float = 0.9) -> torch.Tensor:
    """FedPHP's momentum mu_k = clip(mu_max * Q_k / max(floor(q T), 1), 0, mu_max), Q_k the number
    of earlier visits of the client, q T its expected number of visits in the run. A first visit
    gives 0: the HPM becomes the newly personalised model."""
    return torch.clamp(mu_max * visits / max(math.floor(expected_visits), 1), 0.0, mu_max)


def adam_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, lr: float,
              betas=(0.9, 0.999), eps: float = 1e-8) -> None:
    """torch.optim.Adam's step ``step`` (1, 2, ...) on ``p`` in place, its moments ``m``, ``v`` (no weight decay,
    no amsgrad): PeFLL's server, FedCOG's synthetic inputs."""
    m.lerp_(g, 1 - betas[0])
    v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
    denom = (v.sqrt() / math.sqrt(1 - betas[1] ** step)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - betas[0] ** step))


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 4.0,
            form: str = "paper", mean=torch.mean) -> torch.Tensor:
    """Knowledge distillation from the HPM (teacher) to the model being trained.

    paper: KL(softmax(g_p / T) || softmax(g / T)) * T^2, mean over the batch.
    code (FedPHP reference): cross-entropy from softmax(g_p / T) to softmax(g), no T on the student,
    no T^2."""
    p_teacher = F.softmax(teacher_logits / temperature, dim=-1)
    if form == "paper":
        log_student = F.log_softmax(student_logits / temperature, dim=-1)
        kl = (p_teacher * (torch.log(p_teacher.clamp(min=1e-12)) - log_student)).sum(-1)
        return mean(kl) * temperature ** 2
    return mean(-(p_teacher * F.log_softmax(student_logits, dim=-1)).sum(-1))


def mmd2(x: torch.Tensor, y: torch.Tensor, scales=(0.25, 0.5, 1.0, 2.0, 4.0)) -> torch.Tensor:
    """Squared MMD, biased estimator, with a sum of Gaussian kernels exp(-||a - b||^2 / (s * b0))
    for s in ``scales``, b0 = mean pairwise squared distance of the pooled samples (detached).

    A batch of one sample gives zero: then b0 is the single distance ||x - y||^2 itself, the value is
    a constant and its gradient, proportional to (x - y) / ||x - y||^2, is pure rounding noise that
    grows as the local model approaches the global one (seen on clients whose last batch has one
    sample)."""
    if x.shape[0] < 2:
        return x.sum() * 0.0
    pooled = torch.cat([x, y])
    # Exact squared differences, not cdist: cdist's sqrt has no gradient at the zero diagonal and
    # its matmul path (chosen by batch size) cancels catastrophically, so it differs under vmap.
    d2 = (pooled.unsqueeze(0) - pooled.unsqueeze(1)).pow(2).sum(-1)
    n = pooled.shape[0]
    b0 = (d2.sum() / (n * n - n)).detach().clamp(min=1e-12)
    k = sum(torch.exp(-d2 / (s * b0)) for s in scales)
    m = x.shape[0]
    return k[:m, :m].mean() + k[m:, m:].mean() - 2 * k[:m, m:].mean()


def decorrelation_loss(z: torch.Tensor, form: str = "code", eps: float = 1e-8) -> torch.Tensor:
    """FedDecorr's regulariser on the batch features z [N, d], standardised per dimension over
    the batch, (z - mean) / sqrt(var + eps) (unbiased variance and eps = 1e-8, as the official
    ``FedDecorrLoss``), giving Zs.

    * ``code`` (official code, yutingshi/FedDecorr, the default): the mean of the squared
      off-diagonal entries of Zs^T Zs, divided by N.
    * ``paper`` (Shi et al., ICLR 2023, Eq. 4): (1/d^2) ||K||_F^2 with K = Zs^T Zs / N the
      correlation matrix (diagonal included).

    A batch of one sample gives an exact zero (no correlation is defined)."""
    n, d = z.shape
    if n < 2:
        return z.sum() * 0.0
    zs = (z - z.mean(0, keepdim=True)) / torch.sqrt(z.var(0, keepdim=True) + eps)
    gram = zs.T @ zs
    if form == "paper":
        return (gram / n).pow(2).sum() / d ** 2
    off = gram.pow(2).sum() - torch.diagonal(gram).pow(2).sum()
    return off / max(d * (d - 1), 1) / n


def balanced_softmax_loss(logits: torch.Tensor, y: torch.Tensor, class_counts: torch.Tensor,
                          ce=F.cross_entropy) -> torch.Tensor:
    """Balanced softmax (FedROD Eq. 5, after Ren et al. 2020): CE(logits + log n_c, y) with the
    client's class counts n_c; a class it lacks gets log(1e-12), numerically removed."""
    return ce(logits + torch.log(class_counts.clamp(min=1e-12)), y)


def label_discrepancy(counts: torch.Tensor, metric: str = "kl") -> torch.Tensor:
    """FedDisco's discrepancy d_k between each client's label distribution (rows of ``counts``
    [K, C], normalised) and the uniform distribution over the C classes (the official code's
    ``global_dist`` for a balanced test set; MediaBrain-SJTU/FedDisco disco.py,
    ``get_distribution_difference``): ``kl``: KL(p_k || u), then divided by its sum over the K
    clients given (0 if that sum is 0); ``l1``, ``l2``: ||p_k - u||; ``cosine``: 1 - cos(p_k, u)."""
    p = counts.double() / counts.double().sum(1, keepdim=True)
    u = torch.full_like(p[0], 1.0 / p.shape[1])
    if metric == "kl":
        d = torch.where(p > 0, p * torch.log(p / u), torch.zeros_like(p)).sum(1)
        return d / d.sum() if d.sum() > 0 else torch.zeros_like(d)
    if metric == "l1":
        return (p - u).abs().sum(1)
    if metric == "l2":
        return (p - u).norm(dim=1)
    if metric == "cosine":
        return 1.0 - (p @ u) / (p.norm(dim=1) * u.norm())
    raise ValueError(f"unknown discrepancy metric {metric!r}")


def disco_weights(p: torch.Tensor, d: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """FedDisco's aggregation weights: ReLU(p_k - a d_k + b), normalised to sum 1 (official
    ``disco_weight_adjusting``), with p_k the FedAvg weights of the round's clients. Where no
    client keeps a positive weight (a d_k >= p_k + b for all; the official code fails there) the
    FedAvg weights stay."""
    w = p - a * d + b
    if not bool((w > 0).any()):
        return p
    w = w.clamp(min=0.0)
    return w / w.sum()


def sam_perturbation(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], rho: float,
                     adaptive: bool = False, eta: float = 0.0) -> dict[str, torch.Tensor]:
    """The ascent step eps of sharpness-aware minimisation for stacked tensors [G, ...], each
    client (leading dimension) on its own gradient norm. SAM (Foret et al., ICLR 2021; FedSAM, Qu
    et al., ICML 2022): eps = rho g / ||g||. ASAM (Kwon et al., ICML 2021; FedASAM, Caldarola et
    al., ECCV 2022): eps = rho T^2 g / ||T g|| with T = |w| + eta on tensors whose name contains
    ``weight`` and T = 1 on the others (the official ``ASAM.ascent_step``, debcaldarola/fedsam);
    ||.|| is the norm over all tensors given, + 1e-16."""
    scale = {k: params[k].abs() + eta if adaptive and "weight" in k else None for k in grads}
    tg = {k: g if scale[k] is None else g * scale[k] for k, g in grads.items()}
    norm = torch.sqrt(sum(t.pow(2).flatten(1).sum(1) for t in tg.values())) + 1e-16
    coef = rho / norm
    return {k: (t if scale[k] is None else t * scale[k]) * coef.view(-1, *[1] * (t.dim() - 1)) for k, t in tg.items()}


def variance_loss(logits: torch.Tensor) -> torch.Tensor:
    """FedUV's classifier-variance term (Son et al., CVPR 2024; sonhamin/FedUV ``UVReg``): the
    mean over classes of ReLU(gamma - std_batch softmax(logits)_c), gamma = 1/sqrt(C) (the std of
    a column of the identity, the official ``torch.eye(C).std(0).mean()``), unbiased std over the
    batch. A batch of one sample gives 0."""
    n, c = logits.shape
    if n < 2:
        return logits.sum() * 0.0
    gamma = 1.0 / math.sqrt(c)
    return F.relu(gamma - F.softmax(logits, dim=1).std(dim=0)).mean()


def uniformity_loss(z: torch.Tensor) -> torch.Tensor:
    """FedUV's hyperspherical-uniformity term: the mean over pairs i < j of exp(-||z_i - z_j||^2 /
    sigma), sigma the median of the non-zero squared distances (the lower middle value, as
    ``torch.median``); written without data-dependent shapes, so it runs under ``vmap``. A batch
    of one sample gives 0."""
    n = z.shape[0]
    if n < 2:
        return z.sum() * 0.0
    i, j = torch.triu_indices(n, n, offset=1, device=z.device)
    d = (z[i] - z[j]).pow(2).sum(1)
    sigma = torch.where(d != 0, d, torch.full_like(d, float("nan"))).nanmedian()  # differentiated, as the official
    return torch.exp(-d / sigma).mean()
