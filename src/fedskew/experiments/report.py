"""Reports of a sweep in the papers' layout: Markdown and one self-contained HTML page.

Tables (rows = partitions, columns = methods, mean +- sample std over seeds, best per row in
bold): the main metric, the gain of every method over the baseline (FedAvg) and over the best
other method, personalised accuracy, rounds to reach the baseline's best accuracy and the
speed-up (FedMR Table 4, FedKA Table 2), communication per round and cumulative, and time per
round next to accuracy (the FedMR-Lite trade-off). Plots (matplotlib): accuracy curves with
seed bands, the partition heatmaps, per-class accuracy, and the personalisation fairness
histogram (per-client change vs the baseline, MAP Figure 10).

Every number comes from the runs the selection chose (``selections``: one grid point per method
and partition), named in the report with the split it was chosen on.
"""

from __future__ import annotations

import base64
import html
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from fedskew.config import ConfigError
from fedskew.engine.durable import atomic_write, atomic_write_text
from fedskew.experiments.plots import plot_class_accuracy, plot_curves, plot_fairness
from fedskew.experiments.selection import Results, selected_runs
from fedskew.experiments.store import open_sweep

# ---------------------------------------------------------------------------------------------
# Numbers


def mean_std(values: list[float | None]) -> tuple[float | None, float | None, int]:
    """(mean, sample std (0 for one value), n) of the values that are not None."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None, None, 0
    return statistics.mean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0), len(vals)


SIGNIFICANCE = 0.05  # the paired t-test's level, in every table fedskew prints
CHANCE_MARGIN = 0.01  # a mean within this of chance (1 / classes; one point of accuracy) is never bold
MIN_BOLD_SEEDS = 3  # a paired t-test over two seeds (1 degree of freedom) separates nothing
BOLD_RULE = ("Bold: the top group, read down the means from the best: every mean until the first that a two-sided "
             f"paired t-test over seeds (p < {SIGNIFICANCE}) finds worse than the best, so no bold mean sits below an "
             f"unbolded higher one; nothing is bold with fewer than {MIN_BOLD_SEEDS} seeds, or within one point of "
             f"chance (100 / classes %).")


def paired_test(ours: dict[int, float], base: dict[int, float], level: float = SIGNIFICANCE) -> str | None:
    """Win, tie or loss of ``ours`` against ``base``, paired by seed (same seed: same partition and
    initialisation): a two-sided paired t-test over the common seeds; 'W' or 'L' when p < ``level``,
    else 'T'. None with fewer than two common seeds. (Three seeds give the test little power: most
    differences under a point are ties.)"""
    from scipy.stats import ttest_rel

    seeds = sorted(set(ours) & set(base))
    if len(seeds) < 2:
        return None
    a, b = [ours[s] for s in seeds], [base[s] for s in seeds]
    diffs = [x - y for x, y in zip(a, b)]
    if all(d == diffs[0] for d in diffs):  # no spread: the t statistic is undefined
        return "T" if diffs[0] == 0 else ("W" if diffs[0] > 0 else "L")
    p = float(ttest_rel(a, b).pvalue)
    if p >= level:
        return "T"
    return "W" if statistics.fmean(diffs) > 0 else "L"


def bold_labels(values: dict[str, dict[int, float]], chance: float | None = None, scale: float = 1.0) -> set[str]:
    """The one bold rule of every table fedskew prints (:data:`BOLD_RULE`): among the entries with
    :data:`MIN_BOLD_SEEDS` or more seeds (``values``: entry -> {seed: value}), the best mean, then
    each next lower mean until the first that the paired test finds worse than the best (
    bolding every entry the test does not separate from the best left a higher, low-variance mean
    unbolded above a lower, high-variance bold one in 12 of 35 columns); none when the best is within
    :data:`CHANCE_MARGIN` (times ``scale``: 100 for percent) of ``chance``, and no entry that is."""
    means = {k: statistics.fmean(v.values()) for k, v in values.items() if len(v) >= MIN_BOLD_SEEDS}
    if chance is not None:
        means = {k: m for k, m in means.items() if m > chance + CHANCE_MARGIN * scale}
    if not means:
        return set()
    order = sorted(means, key=lambda k: (-means[k], str(k)))
    best, top = order[0], set()
    for k in order:
        if k != best and paired_test(values[k], values[best]) == "L":
            break
        top.add(k)
    return top


def build_table(cells: dict[tuple[str, str], list[float | None]], rows: list[str], cols: list[str],
                baseline: str | None = "fedavg", chance: float | None = None) -> dict[str, dict[str, dict]]:
    """Per row and column: mean, std, n, ``best`` (the row's highest mean, ties all marked),
    ``top`` (what a table bolds: :func:`bold_labels`, the values of a cell paired with another's by
    position, the selected runs' seed order; ``chance`` a fraction), ``gain_baseline`` (mean minus
    the baseline's mean in the row) and ``gain_best_other`` (mean minus the best mean of the other
    columns of the row)."""
    out: dict[str, dict[str, dict]] = {}
    for r in rows:
        stats = {c: dict(zip(("mean", "std", "n"), mean_std(cells.get((r, c), [])))) for c in cols}
        means = {c: s["mean"] for c, s in stats.items() if s["mean"] is not None}
        top = max(means.values()) if means else None
        base = means.get(baseline) if baseline else None
        bold = bold_labels({c: {i: float(v) for i, v in enumerate(cells.get((r, c), [])) if v is not None}
                            for c in cols}, chance)
        for c, s in stats.items():
            m = s["mean"]
            others = [v for k, v in means.items() if k != c]
            s["best"] = m is not None and m == top
            s["top"] = c in bold
            s["gain_baseline"] = None if m is None or base is None or c == baseline else m - base
            s["gain_best_other"] = None if m is None or not others else m - max(others)
        out[r] = stats
    return out


def mean_curve(histories: list[list[dict]], key: str) -> list[tuple[int, float]]:
    """(round, mean over runs) for the rounds where every run reports ``key``."""
    per_round: dict[int, list[float]] = {}
    for hist in histories:
        for h in hist:
            if h.get(key) is not None:
                per_round.setdefault(h["round"], []).append(float(h[key]))
    return [(t, sum(v) / len(v)) for t, v in sorted(per_round.items()) if len(v) == len(histories)]


def rounds_to_target(curve: list[tuple[int, float]], target: float) -> int | None:
    """The number of rounds (round index + 1) after which the curve first reaches ``target``."""
    for t, v in curve:
        if v >= target - 1e-12:
            return t + 1
    return None


# ---------------------------------------------------------------------------------------------
# Sections (rendered to Markdown and HTML)


@dataclass
class Section:
    title: str
    text: str = ""
    header: list[str] | None = None
    rows: list[list[str]] | None = None  # cells; "**x**" marks the best
    image: Path | None = None


def _pct(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{100 * v:.{digits}f}"


def cell_text(s: dict, scale: float = 100.0, failed: int = 0) -> str:
    """A table cell: mean +- std (``**bold**`` when among the row's top), ``none`` or ``failed (n)``."""
    if s["mean"] is None:
        return f"failed ({failed})" if failed else "none"
    text = f"{scale * s['mean']:.2f}" + (f" +- {scale * s['std']:.2f}" if s.get("n", 2) > 1 else " (1 seed)")
    text = f"**{text}**" if s.get("top") else text
    return f"{text} ({failed} failed)" if failed else text


def metric_title(metric: str) -> tuple[str, float, str]:
    """(title, scale, unit) of a summary metric: accuracies are shown in %, other values as they are."""
    names = {"global/test_acc": "Global accuracy, final round", "global/test_acc_final": "Global accuracy, final round",
             "global/val_acc_final": "Global validation accuracy, final round", "global/test_acc_mean_last10":
             "Global accuracy, mean of the last 10 evaluations", "global/test_acc_mean_last50":
             "Global accuracy, mean of the last 50 evaluations", "global/test_acc_best": "Global accuracy, best round",
             "global/val_acc": "Global validation accuracy, final round", "global/val_acc_mean_last10":
             "Global validation accuracy, mean of the last 10 evaluations",
             "personal/final_acc_after": "Personalised accuracy (all clients, after one more local pass)",
             "personal/final_acc_before": "Accuracy of the final global model on every client's local test split",
             "unseen/final_acc_after": "Accuracy on clients never trained on, after the method's personalisation",
             "unseen/final_acc_before": "Accuracy of the final global model on clients never trained on",
             "personal/final_val_acc_after": "Personalised validation accuracy (hold-out, weighted to each "
                                              "client's classes)"}
    title = names.get(metric, metric)
    if "acc" in metric.rsplit("/", 1)[-1]:
        return title, 100.0, " (%)"
    return title, 1.0, ""


def _signed(v: float | None, scale: float = 100.0) -> str:
    return "-" if v is None else f"{scale * v:+.2f}"


def _values(res: Results, key: str) -> dict[tuple[str, str], list]:
    """(partition, method) -> the metric of each selected run (build_table's (row, column) keys)."""
    return {(p, c): [r.summary.get(key) for r in runs] for (c, p), runs in res.runs.items()}


# classes of the data sets whose accuracy a table may bold (chance = 1 / classes); others: no chance rule
CLASSES = {"digits": 10, "mnist": 10, "fmnist": 10, "cifar10": 10, "svhn": 10, "cinic10": 10, "cifar100": 100,
           "femnist": 62, "tinyimagenet": 200}


def chance_of(dataset: str | None, metric: str) -> float | None:
    """Chance accuracy (a fraction) of ``metric`` on ``dataset``; None for other metrics or data sets."""
    if "acc" not in metric or dataset not in CLASSES:
        return None
    return 1.0 / CLASSES[dataset]


def metric_sections(res: Results, metric: str, baseline: str | None) -> list[Section]:
    title, scale, unit = metric_title(metric)
    dataset = next((r.summary.get("dataset") for runs in res.runs.values() for r in runs), None)
    table = build_table(_values(res, metric), res.partitions, res.labels, baseline, chance_of(dataset, metric))
    n_seeds = max((len(v) for v in res.runs.values()), default=0)
    failed = {(p, c): n for (c, p), n in res.failed.items()}
    spread = f"mean +- std over {n_seeds} seeds" if n_seeds > 1 else "one seed (no spread, nothing bold)"
    main = Section(
        f"{title}{unit}: `{metric}`, {spread}",
        f"Rows: partitions; columns: methods. {BOLD_RULE} "
        "`none`: the method has no model for this metric (e.g. no global model); `failed (n)`: every run "
        "of the cell failed (n runs; the errors are in the results database).",
        ["partition", *res.labels],
        [[p, *(cell_text(table[p][c], scale, failed.get((p, c), 0)) for c in res.labels)] for p in res.partitions],
    )
    gains = Section(f"{title}: gain over {baseline or '-'} / over the best other method"
                    f"{' (points)' if unit else ''}",
                    "Each cell: the method's mean minus the baseline's, then minus the best other method's mean "
                    "in the row (positive only for the row's best).",
                    ["partition", *res.labels],
                    [[p, *(f"{_signed(table[p][c]['gain_baseline'], scale)} / "
                           f"{_signed(table[p][c]['gain_best_other'], scale)}"
                           for c in res.labels)] for p in res.partitions])
    return [main, gains] if baseline else [main]


TARGET_FRACTION = 0.95


def rounds_section(res: Results, baseline: str | None, key: str = "global/test_acc",
                   fraction: float = TARGET_FRACTION) -> Section | None:
    """Rounds to reach ``fraction`` of the baseline's best seed-mean accuracy (FedMR Table 4,
    FedKA Table 2 use a fixed target accuracy). A fraction, not the best itself: the baseline
    reaches its own best only at its peak round, which on a short budget is the last one, and
    every speed-up would then measure noise at the end of the curve."""
    if not baseline or baseline not in res.labels:
        return None
    rows = []
    for p in res.partitions:
        base = mean_curve([r.history for r in res.runs.get((baseline, p), [])], key)
        if not base:
            continue
        target = fraction * max(v for _, v in base)
        r_base = rounds_to_target(base, target)
        cells = []
        for c in res.labels:
            curve = mean_curve([r.history for r in res.runs.get((c, p), [])], key)
            rt = rounds_to_target(curve, target) if curve else None
            cells.append("not reached" if rt is None else f"{rt} ({r_base / rt:.2f}x)")
        rows.append([p, _pct(target), *cells])
    pct = f"{100 * fraction:g}%"
    return Section(f"Rounds to reach {pct} of {baseline}'s best accuracy (speed-up vs {baseline})",
                   f"Target: {pct} of the best value of {baseline}'s seed-mean `{key}` curve; each cell: the first "
                   f"round at which the method's seed-mean curve reaches it, and {baseline}'s rounds divided by "
                   f"the method's.", ["partition", "target (%)", *res.labels], rows)


def _partition_picture(path: Path) -> bytes | None:
    """A run's partition heatmap through the file boundary (a PNG of at most 16 MB), or None."""
    from fedskew.files import FileProblem, read_bytes

    try:
        data = read_bytes(path, "partition picture", own=True, limit=16 << 20)
    except FileProblem:
        return None
    return data if data.startswith(b"\x89PNG\r\n\x1a\n") else None


def comm_section(res: Results) -> Section:
    rows = []
    for p in res.partitions:
        for c in res.labels:
            runs = res.runs.get((c, p), [])
            # (a summary without its counts or rounds, edited or damaged, gives no row)
            totals = [r.summary["comm/up_floats_total"] + r.summary["comm/down_floats_total"] for r in runs
                      if r.summary.get("comm/up_floats_total") is not None
                      and r.summary.get("comm/down_floats_total") is not None]
            rounds = runs[0].summary.get("rounds") if runs else None
            if not totals or not rounds or rounds < 1:
                continue
            total = sum(totals) / len(totals)
            extra = runs[0].summary.get("comm/extra_pct")
            rows.append([p, c, f"{total / rounds:,.0f}", f"{total:,.0f}", "-" if extra is None else f"{extra:.2f}"])
    return Section("Communication", "Floats exchanged (up + down, all selected clients), per round and cumulative "
                   "over the run; extra: beyond the model, in % of the model's floats.",
                   ["partition", "method", "per round", "cumulative", "extra (%)"], rows)


def time_section(res: Results, metric: str) -> Section:
    title, scale, unit = metric_title(metric)
    rows = []
    for p in res.partitions:
        for c in res.labels:
            runs = res.runs.get((c, p), [])
            if runs:
                # the median round of each run: round 0 pays the warm-up (first calls, padding checks)
                t, _, _ = mean_std(
                    [
                        statistics.median(h["time/round_s"] for h in r.history if h.get("time/round_s") is not None)
                        if any(h.get("time/round_s") is not None for h in r.history)
                        else r.summary.get("time/round_s_mean")
                        for r in runs
                    ]
                )
                acc, sd, n = mean_std([r.summary.get(metric) for r in runs])
                shown = "none" if acc is None else f"{scale * acc:.2f}" + (f" +- {scale * sd:.2f}" if n > 1 else "")
                rows.append([p, c, "-" if t is None else f"{t:.3f}", shown])
    import json

    uses_lite = '"lite_n"' in json.dumps(res.spec or {}) or any(
        r.params.get("lite_n") is not None for runs in res.runs.values() for r in runs)  # (FedMR-Lite ran here)
    lite = " (FedMR-Lite: FedMR with its inter-class loss on n samples of each batch, option lite_n)" \
        if uses_lite else ""
    return Section(f"Time per round and {metric}", "Wall time per round (each run's median round, then the mean over "
                   "seeds; same machine, same sweep) next to the main metric: the cost/accuracy trade-off" + lite + ".",
                   ["partition", "method", "time per round (s)", f"{metric}{unit}"], rows)


def selection_section(res: Results) -> Section | None:
    def split(name: str) -> str:
        return "test set (test-set selection)" if name == "test" else f"{name} hold-out"

    def chose(sel: dict) -> bool:  # (a method with one point chose nothing)
        try:
            return len(json.loads(sel.get("candidates") or sel.get("means") or "{}")) > 1  # (stored / computed)
        except (TypeError, ValueError):
            return True

    rows = [[p, c, sel["params"], sel["metric"], split(sel["split"]), _pct(sel["value"])]
            for p in res.partitions for c in res.labels if (sel := res.selections.get((c, p))) and chose(sel)]
    if not rows:
        return None
    on_test = any(r[4].startswith("test") for r in rows)
    return Section("Hyper-parameters chosen", "Per method and partition: the grid point with the best mean over "
                   "seeds of the selection metric, and the split it was chosen on." + (
                       " Test-set selection: the test set chose among the grid points, as the protocol being "
                       "reproduced did, so these scores are not held-out estimates." if on_test else ""),
                   ["partition", "method", "options", "selection metric", "split", "value (%)"], rows)


# ---------------------------------------------------------------------------------------------
# Rendering


def _has(res: Results, key: str) -> bool:
    return any(r.summary.get(key) is not None for runs in res.runs.values() for r in runs)


def build_sections(res: Results, out: Path, metric: str, baseline: str | None) -> list[Section]:
    if baseline not in res.labels:
        baseline = None
    sections = metric_sections(res, metric, baseline)
    final = metric.removesuffix("_mean_last10")
    if final != metric and _has(res, final):  # beside a mean over rounds: the last round's value
        sections += metric_sections(res, final, baseline)[:1]
    personal = "personal/final_acc_after"
    if personal != metric and _has(res, personal):
        sections += metric_sections(res, personal, baseline)[:1]
    for extra in (rounds_section(res, baseline), comm_section(res), time_section(res, metric), selection_section(res)):
        if extra is not None:
            sections.append(extra)
    for i, p in enumerate(res.partitions):
        slug = f"p{i}"
        curve = plot_curves(res, p, "global/test_acc", out / f"curves_{slug}.png")
        if curve:
            sections.append(Section(f"Accuracy curves: {p}", image=curve))
        runs = next((r for c in res.labels for r in res.runs.get((c, p), [])), None)
        picture = _partition_picture(runs.run_dir / "partition.png") if runs is not None else None
        if picture is not None:
            target = out / f"partition_{slug}.png"
            atomic_write(lambda fh, data=picture: fh.write(data), target)
            sections.append(Section(f"Partition: {p} (seed {runs.seed})", image=target))
        bars = plot_class_accuracy(res, p, out / f"classes_{slug}.png")
        if bars:
            sections.append(Section(f"Per-class accuracy: {p}", image=bars))
        if baseline:
            hist = plot_fairness(res, p, baseline, out / f"fairness_{slug}.png")
            if hist:
                sections.append(Section(f"Personalisation fairness vs {baseline}: {p}", image=hist))
    return sections


def to_markdown(title: str, sections: list[Section], out: Path) -> str:
    lines = [f"# {title}", ""]
    for s in sections:
        lines += [f"## {s.title}", ""]
        if s.text:
            lines += [s.text, ""]
        if s.header:
            lines += ["| " + " | ".join(s.header) + " |", "|" + "---|" * len(s.header)]
            lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in s.rows]
            lines.append("")
        if s.image:
            lines += [f"![{s.title}]({s.image.relative_to(out)})", ""]
    return "\n".join(lines)


_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1.5em}th,td{border:1px solid #bbb;padding:4px 8px;text-align:right}
th:first-child,td:first-child{text-align:left}th{background:#eee}td.best{font-weight:bold;background:#e8f4e8}
img{max-width:100%;border:1px solid #ddd;margin-bottom:1.5em}p.note{color:#555;font-size:90%}"""


def to_html(title: str, sections: list[Section]) -> str:
    """One self-contained page: inline CSS, plots embedded as base64 PNG."""
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    for s in sections:
        parts.append(f"<h2>{html.escape(s.title.replace('`', ''))}</h2>")
        if s.text:
            parts.append(f"<p class='note'>{html.escape(s.text.replace('`', ''))}</p>")
        if s.header:
            parts.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in s.header) + "</tr>")
            for row in s.rows:
                cells = []
                for c in row:
                    c = str(c)
                    best = c.startswith("**") and c.endswith("**")
                    text = html.escape(c.strip("*"))
                    cells.append(f"<td class='best'>{text}</td>" if best else f"<td>{text}</td>")
                parts.append("<tr>" + "".join(cells) + "</tr>")
            parts.append("</table>")
        if s.image:
            data = base64.b64encode(s.image.read_bytes()).decode()
            parts.append(f"<img alt='{html.escape(s.title)}' src='data:image/png;base64,{data}'>")
    # Marks how many plots decoded (read by the headless-browser test).
    parts.append("<script>window.addEventListener('load',function(){var n=0;for(var i of document.images)"
                 "{if(i.complete&&i.naturalWidth>0)n++;}document.body.setAttribute('data-images-loaded',n);});"
                 "</script></body></html>")
    return "".join(parts)


DEFAULT_METRICS = ("global/test_acc_mean_last10", "personal/final_acc_after", "personal/acc_after")


def default_metric(res: Results) -> str:
    """The metric of a report whose command and sweep file name none: the global model's accuracy,
    or, when no finished run has a global model (a sweep of FedCP, GPFL, pFedHN, ... alone), the
    first personalised accuracy the runs recorded."""
    known = {k for runs in res.runs.values() for r in runs for k, v in r.summary.items() if v is not None}
    return next((m for m in DEFAULT_METRICS if m in known), DEFAULT_METRICS[0])


def check_metric_and_baseline(res: Results, metric: str, baseline: str | None) -> None:
    """A report of a metric no run recorded, or against a method the sweep does not have, would be
    a table of blanks: refuse it with one sentence."""
    from fedskew.config import ConfigError, did_you_mean

    known = sorted({k for runs in res.runs.values() for r in runs for k, v in r.summary.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)})
    if known and metric not in known:
        raise ConfigError(f"report metric '{metric}' is in no finished run's summary{did_you_mean(metric, known)}; "
                          f"allowed: {', '.join(k for k in known if not k.startswith('global/class_acc/'))}.")
    if baseline is not None and baseline not in res.labels:
        raise ConfigError(f"report baseline '{baseline}' is not a method of this sweep"
                          f"{did_you_mean(baseline, res.labels)}; its methods: {', '.join(res.labels)}.")


def write_report(sweep_dir: str | Path, out: str | Path | None = None, metric: str | None = None,
                 baseline: str | None = None) -> tuple[Path, Path]:
    """Write ``report.md``, ``report.html`` and the plots for a sweep folder; returns both paths."""
    from fedskew.experiments.spec import read_record

    sweep_dir = Path(sweep_dir)
    db = open_sweep(sweep_dir)  # a one-sentence error when it is not a sweep folder
    spec = read_record(sweep_dir)
    opts = spec.get("report", {}) or {}
    chosen_baseline = baseline or opts.get("baseline")
    out = Path(out) if out else sweep_dir / "report"
    try:
        res = selected_runs(db, spec)
    finally:
        db.close()
    if not res.runs and not res.failed:
        raise ConfigError(f"sweep folder '{sweep_dir}' holds no finished run, so no report is written; run the sweep "
                          f"first (`fedskew sweep {sweep_dir / 'sweep.yaml'} --out {sweep_dir}` continues it).")
    metric = metric or opts.get("metric") or default_metric(res)
    check_metric_and_baseline(res, metric, chosen_baseline)
    title = f"fedskew report: {res.name}"
    try:  # every file is complete or absent; a full disk or a read-only folder is one sentence
        out.mkdir(parents=True, exist_ok=True)
        sections = build_sections(res, out, metric, chosen_baseline or "fedavg")
        atomic_write_text(to_markdown(title, sections, out), out / "report.md")
        atomic_write_text(to_html(title, sections), out / "report.html")
    except OSError as exc:
        from fedskew.engine.rundir import StorageError

        raise StorageError(f"writing the report into '{out}' failed ({exc.strerror or exc}); free space, or write it "
                           f"elsewhere with `fedskew report {sweep_dir} --out DIR`: the sweep's results are "
                           f"untouched.") from None
    return out / "report.md", out / "report.html"


__all__ = [
    "BOLD_RULE",
    "MIN_BOLD_SEEDS",
    "bold_labels",
    "build_table",
    "default_metric",
    "paired_test",
    "mean_curve",
    "mean_std",
    "rounds_to_target",
    "write_report",
]
