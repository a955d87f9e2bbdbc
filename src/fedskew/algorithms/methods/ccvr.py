"""ccvr: CCVR (Luo et al., NeurIPS 2021): FedAvg, then classifier calibration with virtual representations. (Family
``classifier``; the class's docstring has the details.)"""

from __future__ import annotations

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
    model_part,
    reference_tensor,
    strip_prefix,
    weighted_mean,
)
from fedskew.algorithms.tensors import class_feature_means
from fedskew.streams import torch_seed


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
    family = "classifier"

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
