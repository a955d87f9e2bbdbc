"""fedpac: FedPAC (Xu et al., ICLR 2023; reference JianXu95/FedPAC). (Family ``classifier``; the class's docstring
has the details.)"""

from __future__ import annotations

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
    family = "classifier"

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
