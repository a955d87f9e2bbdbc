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


def class_roles(counts: torch.Tensor, gamma: float) -> torch.Tensor:
    """Per class of one client (FedKA, Section 3): 0 missing (n_c = 0), 1 non-dominant
    (0 < n_c / n < gamma), 2 dominant (the rest)."""
    counts = counts.to(torch.float64)
    share = counts / counts.sum().clamp(min=1)
    return torch.where(counts == 0, 0, torch.where(share < gamma, 1, 2)).to(torch.long)


ROLE_NAMES = ("missing", "non_dominant", "dominant")


def proxy_record(w_received: torch.Tensor, uploaded: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> dict:
    """``proxy/*``: MAP Figure 6 statistics (:func:`classifier_proxy_stats`) of each uploaded
    classifier ``(weight, observed classes)`` against the received one, mean over clients."""
    values: dict[str, list[float]] = {}
    for w, observed in uploaded:
        for k, v in classifier_proxy_stats(w_received, w, observed.to(w_received.device), lr).items():
            values.setdefault(k, []).append(v)
    return {f"proxy/{k}": sum(v) / len(v) for k, v in sorted(values.items())}


def forgetting_record(model, received: dict, uploads: dict[int, dict], class_counts: torch.Tensor, gamma: float,
                      x_test: torch.Tensor, y_test: torch.Tensor, num_classes: int) -> dict:
    """``forgetting/*``: FedKA's forgetting degree (Eq. 1) of each client's uploaded model
    (``uploads``: client id -> state) vs the global model it received, per class on the test set;
    the mean over (client, class) pairs of each class role (:func:`class_roles` with ``gamma``),
    the per-class values per client and the received model's class accuracies (Eq. 1's reference)."""
    C = num_classes
    present = torch.bincount(y_test, minlength=C) > 0

    def class_acc(state):
        preds = predict(model, state, x_test)
        correct = torch.bincount(y_test[preds == y_test], minlength=C).double()
        return correct / torch.bincount(y_test, minlength=C).clamp(min=1).double()

    global_acc = class_acc(received)
    by_role: dict[int, list[float]] = {0: [], 1: [], 2: []}
    per_client = {}
    for k, state in uploads.items():
        tau = forgetting_degree(global_acc, class_acc(state))
        roles = class_roles(class_counts[k], gamma)
        for c in range(C):
            # Where the global model has 0 accuracy there is nothing to forget and Eq. 1 gives
            # -acc_local / xi (about -1e8): such pairs stay in per_client, not in the means.
            if present[c] and global_acc[c] > 0:
                by_role[int(roles[c])].append(float(tau[c]))
        per_client[str(k)] = [float(t) if present[c] else None for c, t in enumerate(tau)]
    out = {f"forgetting/{ROLE_NAMES[role]}": (sum(v) / len(v) if v else None) for role, v in by_role.items()}
    out["forgetting/per_client"] = per_client
    out["forgetting/global_class_acc"] = global_acc.tolist()
    return out


def client_means(results) -> dict:
    """A round's client results (``ClientResult``) as record entries: the sample-weighted local
    loss and tracked values (``train/*``), the mean and std of the local accuracies before and
    after training (``personal/acc_*``)."""
    n = sum(r.report.num_samples for r in results)
    before, before_std = mean_std([r.acc_before for r in results])
    after, after_std = mean_std([r.acc_after for r in results])
    return {"train/loss": sum(r.train_loss * r.report.num_samples for r in results) / n,
            "personal/acc_before": before, "personal/acc_before_std": before_std,
            "personal/acc_after": after, "personal/acc_after_std": after_std,
            **{f"train/{key}": sum(r.aux[key] * r.report.num_samples for r in results if key in r.aux) /
               sum(r.report.num_samples for r in results if key in r.aux)
               for key in sorted({k for r in results for k in r.aux})}}


def communication(payload: dict, downloads: dict, uploads: list[dict], selected: int, fixed: int,
                  totals: dict) -> dict:
    """``comm/*`` of a round, counted from what was sent: the payload to each of ``selected``
    clients, their own ``downloads``, the ``uploads``, plus ``fixed`` architecture floats; the part
    outside the model (``model.*``) is the extra. Adds to the run's ``totals`` in place."""
    down = count_floats(payload) * selected + sum(count_floats(d) for d in downloads.values()) + fixed
    up = sum(count_floats(u) for u in uploads)
    down_model = down - count_floats({k: v for k, v in payload.items() if not k.startswith("model.")}) * selected
    up_model = sum(count_floats({k: v for k, v in u.items() if k.startswith("model.")}) for u in uploads)
    for key, value in (("down", down), ("up", up), ("down_model", down_model), ("up_model", up_model)):
        totals[key] += value
    return {"comm/down_floats": down, "comm/up_floats": up,
            "comm/down_extra_floats": down - down_model, "comm/up_extra_floats": up - up_model,
            "comm/down_floats_total": totals["down"], "comm/up_floats_total": totals["up"]}


def run_summary(history: list[dict], totals: dict) -> dict:
    """What ``summary.json`` reports of a run's rounds, each name saying which rounds it reads: the
    global accuracy of the last evaluation (``_final``), the best one (``_best``, ``_best_round``)
    and the mean of the last 10 and 50 evaluations (none without a global model); the last round's
    local accuracies (``_last_round``); communication totals and the extra share beyond the model
    (FedMR Table 3). ``global/test_acc``, ``global/val_acc`` and ``personal/acc_before|after`` are
    the ``_final`` / ``_last_round`` values under their former names."""
    evals = [h for h in history if h.get("global/test_acc") is not None]
    if evals:
        last = evals[-1]
        accs = [h["global/test_acc"] for h in evals]
        best = max(range(len(accs)), key=accs.__getitem__)
        out = {"global/test_acc": last["global/test_acc"], "global/test_acc_final": last["global/test_acc"],
               "global/test_acc_best": accs[best], "global/test_acc_best_round": evals[best]["round"],
               "global/test_acc_mean_last10": sum(accs[-10:]) / len(accs[-10:]),
               "global/test_acc_mean_last50": sum(accs[-50:]) / len(accs[-50:]),  # the ETF paper's Table 1
               **{k: v for k, v in last.items() if k.startswith("global/class_acc/")}}
        vals = [h["global/val_acc"] for h in evals if "global/val_acc" in h]
        if vals:
            out.update({"global/val_acc": vals[-1], "global/val_acc_final": vals[-1],
                        "global/val_acc_mean_last10": sum(vals[-10:]) / len(vals[-10:])})
    else:  # the method has no global model
        out = {k: None for k in ("global/test_acc", "global/test_acc_final", "global/test_acc_best",
                                 "global/test_acc_best_round", "global/test_acc_mean_last10",
                                 "global/test_acc_mean_last50")}
    model_total = totals["up_model"] + totals["down_model"]
    return {
        **out,
        "personal/acc_before": history[-1]["personal/acc_before"],
        "personal/acc_after": history[-1]["personal/acc_after"],
        "personal/acc_before_last_round": history[-1]["personal/acc_before"],
        "personal/acc_after_last_round": history[-1]["personal/acc_after"],
        "comm/down_floats_total": history[-1]["comm/down_floats_total"],
        "comm/up_floats_total": history[-1]["comm/up_floats_total"],
        # (None when no model is exchanged at all: FedProto)
        "comm/extra_pct": 100.0 * (totals["up"] + totals["down"] - model_total) / model_total if model_total else None,
        "time/round_s_mean": sum(h["time/round_s"] for h in history) / len(history),
        "train/loss": history[-1]["train/loss"],
    }
