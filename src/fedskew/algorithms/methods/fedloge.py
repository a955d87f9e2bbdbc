"""fedloge: FedLoGe (Xiao et al., ICLR 2024): a static sparse ETF classifier trains the body, an auxiliary global
head and each client's local head train on its features, realigned by their norms to predict. (Family
``neural_collapse``; the class's docstring has the details.)"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedskew.algorithms.base import (
    FedAvgOptions,
    Method,
    Source,
    as_model_part,
    builtin,
    model_part,
    reference_tensor,
    weighted_mean,
)
from fedskew.models.nets import FixedLinear

AUX, LOCAL, KEEP = "aux.", "local_head.", "loge.local."  # the auxiliary global head, the local head, kept


class FedLoGeOptions(FedAvgOptions):
    search = {"global_scale": [1.0, 1.7, 3.0]}  # the bench's search space (fedskew bench)
    sparsity: float = Field(0.6, ge=0, lt=1, description="share of the ETF's entries set to 0, drawn at random")
    etf_norm: float = Field(0.1, gt=0, description="the norm each class vector of the sparse ETF is refined to")
    refine_steps: int = Field(10000, ge=0, le=100000, description="Adam steps refining the sparse ETF (lr 1e-4)")
    global_scale: float = Field(1.7, gt=0, description="the norm every class row of the auxiliary head is "
                                                       "realigned to for the global prediction")


def sse_c_objective(e: torch.Tensor, norm: float) -> torch.Tensor:
    """The SSE-C refinement loss of E [d, C]: sum_c (||e_c|| - norm)^2 minus the mean over classes of
    the angle to the nearest other class, arccos(clamp(max_{j != c} cos(e_c, e_j), -0.99999, 0.99999))."""
    n = e.norm(dim=0)
    u = e / n
    cos = (u.T @ u).masked_fill(torch.eye(e.shape[1], dtype=torch.bool, device=e.device), -1.0)
    return ((n - norm) ** 2).sum() - torch.acos(cos.max(1).values.clamp(-0.99999, 0.99999)).mean()


def simplex_etf(noise: torch.Tensor) -> torch.Tensor:
    """M [d, C] = sqrt(C / (C - 1)) P (I - 11^T / C), P the reduced QR factor of ``noise`` [d, C]."""
    d, c = noise.shape
    p, _ = torch.linalg.qr(noise)
    return math.sqrt(c / (c - 1)) * p @ (torch.eye(c, dtype=p.dtype) - torch.full((c, c), 1.0 / c, dtype=p.dtype))


def sse_c_gradient(e: torch.Tensor, norm: float) -> torch.Tensor:
    """The gradient of :func:`sse_c_objective` in closed form (what autograd gives, at a tenth of its
    cost per step): 2 (n_c - norm) u_c for the norms, and for each class c with nearest class j and
    cosine m_c inside the clamp, w_c = 1 / (C sqrt(1 - m_c^2)) on the pair, so that column c gets
    sum_j S_cj (u_j - cos_cj u_c) / n_c with S = W + W^T."""
    c = e.shape[1]
    n = e.norm(dim=0)
    u = e / n
    cos = u.T @ u
    m, j = cos.masked_fill(torch.eye(c, dtype=torch.bool, device=e.device), -1.0).max(1)
    inside = (m >= -0.99999) & (m <= 0.99999)
    w = torch.where(inside, 1.0 / (c * torch.sqrt((1 - m * m).clamp(min=1e-30))), torch.zeros_like(m))
    pair = torch.zeros_like(cos)
    pair[torch.arange(c, device=e.device), j] = w
    sym = pair + pair.T
    return 2 * (n - norm) * u + (u @ sym - u * (sym * cos).sum(0)) / n


def sse_c(etf: torch.Tensor, zeros: torch.Tensor, norm: float, steps: int, lr: float = 1e-4) -> torch.Tensor:
    """The static sparse ETF classifier's weight [C, d] (the official ``gen_sparse_ETF``): the ETF [d, C]
    with the flat entries ``zeros`` set to 0, the rest refined by ``steps`` of Adam (torch.optim.Adam's
    update, betas 0.9 and 0.999, eps 1e-8) on :func:`sse_c_objective`, its gradient masked so that
    the zeros stay zeros."""
    e = etf.detach().clone().reshape(-1)
    e[zeros] = 0
    e = e.reshape(etf.shape)
    mask = (e != 0).to(e.dtype)
    m, v = torch.zeros_like(e), torch.zeros_like(e)
    for t in range(1, steps + 1):
        g = sse_c_gradient(e, norm) * mask
        m.mul_(0.9).add_(g, alpha=0.1)
        v.mul_(0.999).addcmul_(g, g, value=0.001)
        denom = (v.sqrt() / math.sqrt(1 - 0.999 ** t)).add_(1e-8)
        e.addcdiv_(m, denom, value=-lr / (1 - 0.9 ** t))
    return e.T.contiguous()


@functools.lru_cache(maxsize=8)
def refined_etf(noise: bytes, d: int, c: int, zeros: bytes, norm: float, steps: int) -> torch.Tensor:
    """:func:`sse_c` of the ETF of a QR ``noise`` [d, C] (float32 bytes) with the flat ``zeros``
    (int64 bytes), once per process (its 10,000 Adam steps take seconds; a sweep builds the model
    of every run and an executor check builds it again)."""
    etf = simplex_etf(torch.frombuffer(bytearray(noise), dtype=torch.float32).reshape(d, c))
    return sse_c(etf, torch.frombuffer(bytearray(zeros), dtype=torch.int64), norm, steps)


def global_realignment(weight: torch.Tensor, scale: float) -> torch.Tensor:
    """GLA-FR's global head: every class row of the auxiliary head rescaled to norm ``scale``."""
    return scale * weight / weight.norm(dim=1, keepdim=True)


def local_realignment(aux: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """GLA-FR's norm transfer: each class row of the auxiliary head times the norm of the local head's row."""
    return aux * local.norm(dim=1, keepdim=True)


@builtin
class FedLoGe(Method):
    """FedLoGe (Xiao, Chen, Liu, Li, Yan, Chen, Zhang, Wu, ICLR 2024, "FedLoGe: Joint Local and Generic
    Federated Learning under Long-tailed Data"), as its official code runs (``fedloge.py``, then
    ``realignment.py``).

    The architecture (``build_model``): the classifier is the static sparse ETF classifier (SSE-C), a
    simplex ETF whose entries are zeroed at random (``sparsity`` 0.6) and the rest refined by Adam
    towards class norms 0.1 and wide angles (``sse_c``), with nn.Linear's random bias, all fixed and
    never sent; beside it an auxiliary global head and a local head (linear, d -> C). Local training
    (one SGD over the three disjoint parts, as the official three optimisers with one lr and momentum):
    CE of the SSE-C logits trains the body; CE of each head on the detached features trains the head.
    The body and the auxiliary head are averaged (FedAvg weights); the local head never leaves the
    client.

    GLA-FR realignment (the official code applies it once to its last checkpoint; here to every scored
    model): the global model predicts with the auxiliary head, each class row rescaled to norm 1.7
    (``global_scale``), its bias kept; a client's personalised model with its local head plus the
    auxiliary head whose rows are scaled by the local head's row norms, classes it has no training
    sample of masked (the official code masks the classes its local test split lacks, a split drawn in
    proportion to the training one). Communication as FedAvg without the local head."""
    family = "neural_collapse"

    name = "fedloge"
    Options = FedLoGeOptions
    source = Source(
        authors="Xiao, Chen, Liu, Li, Yan, Chen, Zhang, Wu",
        title="FedLoGe: Joint Local and Generic Federated Learning under Long-tailed Data",
        venue="ICLR",
        year=2024,
        arxiv="2401.08977",
        implements="the static sparse ETF classifier (SSE-C) and the global and local adaptive feature "
                   "realignment (GLA-FR)",
        code="ZackZikaiXiao/FedLoGe (fedloge.py, realignment.py, util/etf_methods.py at f4cac52)")
    requires_classifier = "linear"
    per_sample_loss = True  # Method.padding_exact

    @classmethod
    def build_model(cls, model, options, rebuild):
        """The SSE-C (drawn from the model-initialisation stream: the QR noise, the zeroed entries,
        nn.Linear's bias) and the two trained heads."""
        d, c = model.feature_dim, model.classifier.out_features
        if d < c:
            raise ValueError(f"method fedloge needs a feature dimension of at least the {c} classes for its ETF "
                             f"classifier, but the model gives {d}; widen the model's last hidden layer.")
        noise = torch.rand(d, c)
        zeros = torch.randperm(d * c)[:int(options.sparsity * d * c)]
        bias = nn.Linear(d, c).bias.detach()
        weight = refined_etf(noise.numpy().tobytes(), d, c, zeros.numpy().tobytes(), options.etf_norm,
                             options.refine_steps)
        model.classifier = FixedLinear(weight.clone(), bias)
        model.fixed_keys = frozenset({"classifier.weight", "classifier.bias"})
        model.aux = nn.Linear(d, c)
        model.local_head = nn.Linear(d, c)
        return model

    def client_init(self, client_id, global_state, info):
        ref = reference_tensor(global_state)
        state = {KEEP + k[len(LOCAL):]: v.clone() for k, v in global_state.items() if k.startswith(LOCAL)}
        state["loge.absent"] = (info.class_counts[client_id] == 0).to(ref)
        return state

    def local_start(self, payload, client_state):
        own = {LOCAL + k[len(KEEP):]: v for k, v in client_state.items() if k.startswith(KEEP)}
        return {**model_part(payload), **own}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, logits = fwd(x)
        zd = z.detach()
        body = fwd.cross_entropy(logits, y)
        aux = fwd.cross_entropy(F.linear(zd, params[AUX + "weight"], params[AUX + "bias"]), y)
        own = fwd.cross_entropy(F.linear(zd, params[LOCAL + "weight"], params[LOCAL + "bias"]), y)
        return body + aux + own, {"fedloge/sse": body.detach(), "fedloge/aux": aux.detach(),
                                  "fedloge/local": own.detach()}

    def after_training(self, trained, payload, client_state, report):
        kept = {**client_state, **{KEEP + k[len(LOCAL):]: v for k, v in trained.items() if k.startswith(LOCAL)}}
        return as_model_part({k: v for k, v in trained.items() if not k.startswith(LOCAL)}), kept

    def aggregate(self, server_state, global_state, uploads, reports):
        new = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        return {**new, **{k: v for k, v in global_state.items() if k.startswith(LOCAL)}}, server_state

    def evaluation_state(self, global_state, server_state):
        return {**global_state, "classifier.weight": global_realignment(global_state[AUX + "weight"],
                                                                        self.opt.global_scale),
                "classifier.bias": global_state[AUX + "bias"]}

    def personal_state(self, trained, client_state):
        local_w, local_b = trained[LOCAL + "weight"], trained[LOCAL + "bias"]
        weight = local_w + local_realignment(trained[AUX + "weight"], local_w)
        bias = local_b + trained[AUX + "bias"] - 1e30 * client_state["loge.absent"]
        return {**trained, "classifier.weight": weight, "classifier.bias": bias}
