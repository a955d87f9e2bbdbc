"""The plots of a report (matplotlib, Agg backend, PNG): accuracy curves with seed bands, per-class
accuracy of the final global model, and the personalisation fairness histogram (per-client change
vs the baseline, MAP Figure 10)."""

from __future__ import annotations

import statistics
from pathlib import Path

from fedskew.experiments.store import Results


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(plt, fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """Label, legend, save as PNG, close."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_curves(res: Results, partition: str, key: str, path: Path) -> Path | None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    drawn = False
    for c in res.labels:
        runs = res.runs.get((c, partition), [])
        series = [[(h["round"] + 1, h[key]) for h in r.history if h.get(key) is not None] for r in runs]
        series = [s for s in series if s]
        if not series:
            continue
        length = min(len(s) for s in series)
        xs = [s[0] for s in series[0][:length]]
        ys = [[s[i][1] * 100 for s in series] for i in range(length)]
        mean = [statistics.mean(v) for v in ys]
        sd = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in ys]
        line, = ax.plot(xs, mean, label=c, lw=1.5)
        ax.fill_between(xs, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)],
                        color=line.get_color(), alpha=0.2)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    return _finish(plt, fig, ax, path, "round", f"{key} (%)", f"{partition}: mean +- std over seeds")


def plot_class_accuracy(res: Results, partition: str, path: Path) -> Path | None:
    plt = _plt()
    data = {}
    for c in res.labels:
        runs = res.runs.get((c, partition), [])
        keys = sorted({k for r in runs for k in r.summary if k.startswith("global/class_acc/")},
                      key=lambda k: int(k.rsplit("/", 1)[1]))
        if runs and keys:
            data[c] = [statistics.mean(r.summary[k] for r in runs) * 100 for k in keys]
    if not data:
        return None
    classes = len(next(iter(data.values())))
    fig, ax = plt.subplots(figsize=(min(3 + 0.5 * classes, 16), 3.8))
    width = 0.8 / len(data)
    for i, (c, vals) in enumerate(data.items()):
        ax.bar([j + i * width for j in range(classes)], vals, width, label=c)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(classes)], [str(j) for j in range(classes)])
    return _finish(plt, fig, ax, path, "class", "global test accuracy (%)",
                   f"{partition}: per-class accuracy of the final global model (mean over seeds)")


def plot_fairness(res: Results, partition: str, baseline: str, path: Path) -> Path | None:
    plt = _plt()
    key = "personal/final_acc_after_per_client"
    base = {r.seed: r.summary.get(key) for r in res.runs.get((baseline, partition), [])}
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    drawn = False
    for c in res.labels:
        if c == baseline:
            continue
        diffs = []
        for r in res.runs.get((c, partition), []):
            mine, theirs = r.summary.get(key), base.get(r.seed)
            if mine and theirs:
                diffs += [100 * (a - b) for a, b in zip(mine, theirs) if a is not None and b is not None]
        if diffs:
            ax.hist(diffs, bins=30, alpha=0.5, label=c)
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.axvline(0, color="k", lw=0.8)
    return _finish(plt, fig, ax, path, f"per-client final personalised accuracy minus {baseline}'s (points)",
                   "clients x seeds", partition)


__all__ = ["plot_class_accuracy", "plot_curves", "plot_fairness"]
