"""Metrics with unambiguous meaning (protocols.md, "Evaluation").

- ``global/test_acc``: the aggregated global model on the global (official) test split.
- ``global/class_acc/<c>``: the same, restricted to test samples of class c.
- ``personal/acc_before`` / ``personal/acc_after``: per client, on its local test split, the model
  it received and its personalised model; mean over the clients selected in the round
  (``*_std``: standard deviation across those clients, the fairness figure).
- ``comm/down_floats`` / ``comm/up_floats``: numbers of tensor elements actually sent in the
  round, summed over the selected clients (``comm/*_total``: cumulative); ``comm/*_extra_floats``:
  the part that is not the model (prototypes, control variates, ...).
- ``features/eig_var_top50``, ``features/live_units``: with ``feature_stats=true``, FedMR's Table 7
  statistic and the number of feature units alive on the same samples.
- ``forgetting/*``: with ``forgetting_stats=true``, FedKA's forgetting degree (Eq. 1,
  :func:`forgetting_degree`) of each uploaded model per class, grouped by the class's role.
- ``proxy/*``: with ``classifier_stats=true``, MAP's Figure 6 statistics of the uploaded
  classifiers (:func:`classifier_proxy_stats`), averaged over the selected clients.
"""

from __future__ import annotations

import math

import torch

from fedskew.models.functional import feature_fn, predict


def count_floats(tensors: dict[str, torch.Tensor]) -> int:
    """Elements in a payload or upload: what a client receives or sends."""
    return int(sum(t.numel() for t in tensors.values()))


def class_accuracy(preds: torch.Tensor, labels: torch.Tensor, num_classes: int) -> list[float | None]:
    """Accuracy per class (None for a class absent from ``labels``)."""
    correct = torch.bincount(labels[preds == labels], minlength=num_classes).cpu()
    total = torch.bincount(labels, minlength=num_classes).cpu()
    return [float(correct[c] / total[c]) if total[c] else None for c in range(num_classes)]


def global_metrics(model, state, x_test: torch.Tensor, y_test: torch.Tensor, num_classes: int) -> dict:
    preds = predict(model, state, x_test)
    out = {"global/test_acc": (preds == y_test).float().mean().item()}
    for c, acc in enumerate(class_accuracy(preds, y_test, num_classes)):
        out[f"global/class_acc/{c}"] = acc
    return out


def feature_stats(model, state, x_test: torch.Tensor, n: int = 128) -> dict[str, float]:
    """On the global model's features of the first ``n`` global test samples:
    ``features/eig_var_top50``, FedMR Table 7 (:func:`eig_var_top50`),
    and beside it ``features/live_units`` / ``features/dim``: how many feature units are non-zero
    for at least one of the samples. A model whose units are all dead scores eig_var 0, which
    would otherwise read as perfectly decorrelated."""
    z, _ = feature_fn(model, x_test[:n], None)(state)
    return {"features/eig_var_top50": eig_var_top50(z), "features/live_units": live_units(z),
            "features/dim": z.shape[1]}


def eig_var_top50(features: torch.Tensor, top: int = 50) -> float:
    """FedMR Table 7: eigenvalues of the feature covariance of a batch (128 test samples), sorted
    descending, the top 50 (all if d < 50); their variance written as in the paper,
    (1/128) * sum_i (l_i - mean)^2 (the 1/128 is the paper's, whatever the number kept)."""
    z = features.double()
    cov = torch.cov(z.T)
    eig = torch.linalg.eigvalsh(cov).flip(0)[:top]
    return float(((eig - eig.mean()) ** 2).sum() / 128)


def live_units(features: torch.Tensor) -> int:
    """How many feature units (columns) are non-zero for at least one sample: ReLU units that are
    not dead on this batch."""
    return int((features != 0).any(0).sum())


def forgetting_degree(global_class_acc: torch.Tensor, local_class_acc: torch.Tensor, xi: float = 1e-8) -> torch.Tensor:
    """tau^c = (acc_c(global) - acc_c(local)) / (acc_c(global) + xi), per class; in (-inf, 1],
    positive = forgetting."""
    return (global_class_acc - local_class_acc) / (global_class_acc + xi)


def mean_std(values: list[float | None]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    mean = sum(vals) / len(vals)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))


def classifier_proxy_stats(w_start: torch.Tensor, w_trained: torch.Tensor, observed: torch.Tensor,
                           lr: float) -> dict[str, float]:
    """MAP paper Figure 6 for one client: classifier rows w_c [C, d] of observed classes (O, at
    least one local training sample) and missing ones (M).

    ``norm_O``/``norm_M``: mean ||w_c|| after local training; ``update_O``/``update_M``: mean
    ||w_c(after) - w_c(before)|| / lr, the accumulated gradient of the round (exact for plain SGD,
    momentum included in the sum otherwise); ``dist_OO``/``dist_OM``/``dist_MM``: mean pairwise
    Euclidean distance between rows of the two groups (distinct pairs within a group). A value whose
    group is empty (or has one row, for a within-group distance) is left out."""
    o, m = observed.bool(), ~observed.bool()
    w, delta = w_trained.float(), (w_trained - w_start).float() / lr
    out: dict[str, float] = {}
    for name, mask in (("O", o), ("M", m)):
        if mask.any():
            out[f"norm_{name}"] = w[mask].norm(dim=1).mean().item()
            out[f"update_{name}"] = delta[mask].norm(dim=1).mean().item()
    d = torch.cdist(w, w)
    for name, a, b in (("OO", o, o), ("OM", o, m), ("MM", m, m)):
        block = d[a][:, b]
        if a is b:
            n = int(a.sum())
            if n > 1:
                out[f"dist_{name}"] = (block.sum() / (n * n - n)).item()
        elif block.numel():
            out[f"dist_{name}"] = block.mean().item()
    return out
