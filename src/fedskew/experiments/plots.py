"""The plots of a report (matplotlib, Agg backend, PNG): accuracy curves with seed bands, per-class
accuracy of the final global model, and the personalisation fairness histogram (per-client change
vs the baseline, MAP Figure 10)."""

from __future__ import annotations

import statistics
from pathlib import Path

from fedskew.engine.durable import save_png
from fedskew.experiments.selection import Results


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(fig, ax, path: Path, xlabel: str, ylabel: str, title: str, legend_below: bool = False) -> Path:
    """Label, legend (inside at its best place, or below the axes where it would cover data), save
    as PNG, close."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if legend_below:
        n = len(ax.get_legend_handles_labels()[1])
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=min(n, 5), frameon=False)
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig, path)


def styles(n: int) -> list[dict]:
    """``n`` line styles no two alike: tab10's colours, then tab20's, then dashed and dotted lines."""
    import matplotlib

    colours = matplotlib.colormaps["tab10" if n <= 10 else "tab20"].colors
    dashes = ["-", "--", ":", "-."]
    return [{"color": colours[i % len(colours)], "ls": dashes[i // len(colours) % len(dashes)]} for i in range(n)]


def plot_curves(res: Results, partition: str, key: str, path: Path) -> Path | None:
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.5, 3.8 + 0.25 * max(0, len(res.labels) - 5) // 5))
    drawn = False
    for c, style in zip(res.labels, styles(len(res.labels))):
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
        ax.plot(xs, mean, label=c, lw=1.2, **style)
        ax.fill_between(xs, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)],
                        color=style["color"], alpha=0.1, lw=0)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    return _finish(fig, ax, path, "round", f"{key} (%)", f"{partition}: mean +- std over seeds",
                   legend_below=len(res.labels) > 5)


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
    fig, ax = plt.subplots(figsize=(min(3 + 0.5 * classes, 16), 4.4))
    width = 0.8 / len(data)
    for i, ((c, vals), style) in enumerate(zip(data.items(), styles(len(data)))):
        ax.bar([j + i * width for j in range(classes)], vals, width, label=c, color=style["color"])
    shown = range(0, classes, 1 if classes <= 30 else 5)  # FEMNIST's 62 labels would overlap
    ax.set_xticks([j + 0.4 - width / 2 for j in shown], [str(j) for j in shown])
    ax.set_ylim(0, 100)
    return _finish(fig, ax, path, "class", "global test accuracy (%)",
                   f"{partition}: per-class accuracy of the final global model (mean over seeds)", legend_below=True)


def plot_fairness(res: Results, partition: str, baseline: str, path: Path) -> Path | None:
    """Per-client change of the final personalised accuracy vs the baseline (MAP Figure 10): one
    panel per method on shared bins and axes, so no method hides behind another."""
    key = "personal/final_acc_after_per_client"
    base = {r.seed: r.summary.get(key) for r in res.runs.get((baseline, partition), [])}
    diffs: dict[str, list[float]] = {}
    for c in res.labels:
        if c == baseline:
            continue
        values = []
        for r in res.runs.get((c, partition), []):
            mine, theirs = r.summary.get(key), base.get(r.seed)
            if mine and theirs:
                values += [100 * (a - b) for a, b in zip(mine, theirs) if a is not None and b is not None]
        if values:
            diffs[c] = values
    if not diffs:
        return None
    plt = _plt()
    lo, hi = min(min(v) for v in diffs.values()), max(max(v) for v in diffs.values())
    span = max(hi - lo, 1.0)
    bins = [lo - 0.01 * span + k * 1.02 * span / 30 for k in range(31)]
    n = len(diffs)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(6.5, 3.2 * cols), 2.4 * rows + 0.8), sharex=True, sharey=True,
                             squeeze=False)
    for ax, (c, values) in zip(axes.flat, diffs.items()):
        ax.hist(values, bins=bins, color="tab:blue")
        ax.axvline(0, color="k", lw=0.8)
        ax.set_title(f"{c}: median {sorted(values)[len(values) // 2]:+.1f}", fontsize=9)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.supxlabel(f"per-client final personalised accuracy minus {baseline}'s (points)", fontsize=9)
    fig.supylabel("clients x seeds", fontsize=9)
    fig.suptitle(partition, fontsize=10)
    fig.tight_layout()
    return save_png(fig, path)


__all__ = ["plot_class_accuracy", "plot_curves", "plot_fairness", "styles"]
