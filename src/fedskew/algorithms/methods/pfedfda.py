"""pfedfda: pFedFDA (McLaughlin, Su, NeurIPS 2024), as the authors' code runs it (cj-mclaughlin/pFedFDA
``client_fedfda.py``, ``server_fedfda.py``): the head is the Gaussian generative classifier of shared-covariance
class distributions (``lda_head``). (Family ``classifier``; the class's docstring has the details.)"""

from __future__ import annotations

from typing import Literal

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
    weighted_mean,
)
from fedskew.streams import torch_seed

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
    family = "classifier"

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
