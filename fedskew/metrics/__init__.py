"""Metrics with unambiguous meaning (protocols.md, "Evaluation").

- ``global/test_acc``: the aggregated global model on the global (official) test split.
- ``global/class_acc/<c>``: the same, restricted to test samples of class c.
- ``personal/acc_before`` / ``personal/acc_after``: per client, on its local test split, the model
  it received and its personalised model; mean over the clients selected in the round
  (``*_std``: standard deviation across those clients, the fairness figure).
- ``comm/down_floats`` / ``comm/up_floats``: numbers of tensor elements actually sent in the
  round, summed over the selected clients (``comm/*_total``: cumulative); ``comm/*_extra_floats``:
  the part that is not the model (prototypes, control variates, ...).
- ``features/eig_var_top50``: with ``feature_stats=true``, FedMR's Table 7 statistic.
"""

from __future__ import annotations

import math

import torch

from fedskew.engine.local import predict


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


def feature_eig_var(model, state, x_test: torch.Tensor, n: int = 128) -> float:
    """``features/eig_var_top50``: FedMR Table 7 statistic of the global model's features on the
    first ``n`` global test samples (see :func:`fedskew.methods.fedmr.eig_var_top50`)."""
    from fedskew.engine.local import feature_fn
    from fedskew.methods.fedmr import eig_var_top50

    z, _ = feature_fn(model, x_test[:n], None)(state)
    return eig_var_top50(z)


def mean_std(values: list[float | None]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    mean = sum(vals) / len(vals)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
