"""Command line: ``fedskew run | resume | partition | methods | sweep | report | reproduce | bench | flower``.

``fedskew run [CONFIG.yaml] [key=value ...]`` runs one experiment (with no arguments, FedAvg on
the bundled digits data under a PxCy partition) and prints a results table; ``resume DIR``
continues an interrupted run; ``partition`` prints and draws a partition; ``methods [NAME]`` lists
the methods and their options (``--markdown``: docs/methods.md's reference); ``sweep [FILE]``
runs methods x options x partitions x seeds into a results database (no file: the README's
comparison); ``report DIR`` rebuilds a sweep's tables and plots; ``reproduce NAME`` runs a seed
paper's preset; ``bench SUITE`` runs a benchmark suite and places the published numbers beside
ours; ``flower simulate|app|run`` runs a config on Flower. ``fedskew COMMAND --help``
gives each one's arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fedskew import __version__

EPILOG = "Overrides use dotted keys, e.g. partition.classes_per_client=2 method=fedavg rounds=50."


def _split_args(items: list[str]) -> tuple[str | None, list[str]]:
    config = None
    overrides = []
    for item in items:
        if "=" not in item and config is None and (item.endswith((".yaml", ".yml")) or Path(item).is_file()):
            config = item
        else:
            overrides.append(item)
    return config, overrides


def _fmt(v) -> str:
    if v is None:
        return "none"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def _progress(console: Console, rounds: int):
    """A rich progress bar on a terminal, plain lines otherwise."""
    if console.is_terminal:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        progress = Progress(TextColumn("[bold]round"), MofNCompleteColumn(), BarColumn(),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("left"),
                            TimeRemainingColumn(), console=console)
        task = progress.add_task("rounds", total=rounds, info="")

        def on_round(rec):
            acc = rec.get("global/test_acc")
            progress.update(task, advance=1, info=f"loss {rec['train/loss']:.3f}" +
                            (f"  acc {acc:.3f}" if acc is not None else ""))
        return progress, on_round

    def on_round(rec):
        acc = rec.get("global/test_acc")
        print(f"round {rec['round'] + 1}/{rounds}  train/loss {rec['train/loss']:.4f}" +
              (f"  global/test_acc {acc:.4f}" if acc is not None else "") +
              f"  time/round_s {rec['time/round_s']:.2f}", flush=True)
    return None, on_round


RESULT_ROWS = {  # summary key -> what it is (README, "Metrics: which model, on which data")
    "global/test_acc_final": "global model, global test set, final round",
    "global/test_acc_best": "global model, best round",
    "global/test_acc_mean_last10": "global model, mean of the last 10 evaluations",
    "global/test_acc_mean_last50": "global model, mean of the last 50 evaluations (the ETF paper's Table 1)",
    "personal/acc_before_last_round": "received model, local test sets, last round's clients",
    "personal/acc_after_last_round": "personalised models, local test sets, last round's clients",
    "personal/final_acc_before": "final global model on every (not held-out) client's local test set",
    "personal/final_acc_after": "every (not held-out) client after one more local pass",
    "unseen/final_acc_before": "final global model, held-out clients' local test sets",
    "unseen/final_acc_after": "held-out clients after the method's personalisation pass",
    "comm/down_floats_total": "floats sent to clients, whole run",
    "comm/up_floats_total": "floats sent by clients, whole run",
    "comm/extra_pct": "beyond the model, % of the model's floats",
    "time/round_s_mean": "seconds per round",
}


def _results_table(summary: dict, run_dir: Path) -> Table:
    table = Table(title=f"fedskew {summary['method']} on {summary['dataset']} / {summary['partition']} "
                        f"(seed {summary['seed']}, {summary['rounds']} rounds)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("meaning", style="dim")
    for k, meaning in RESULT_ROWS.items():
        if k in summary:
            v = summary[k]
            shown = f"{100 * v:.2f} %" if isinstance(v, float) and "acc" in k else _fmt(v)
            table.add_row(k, shown, meaning)
    table.caption = f"run directory: {run_dir}"
    return table


def _start_line(cfg, exp) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in full_config(cfg)["method"].items() if k != "name")
    return (f"fedskew {__version__}: {cfg.method.name} ({shown}) on {exp.fed.data.describe()}; "
            f"{cfg.partition.name} partition of {exp.fed.num_clients} clients; model {cfg.model.name}; "
            f"{cfg.rounds} rounds of {cfg.clients_per_round} clients, E={cfg.local_epochs}, B={cfg.batch_size}, "
            f"lr {cfg.lr}{'' if cfg.lr_schedule == 'step' and cfg.lr_decay == 1 else ' (' + cfg.lr_schedule + ')'}, "
            f"{f'momentum {cfg.momentum}' if cfg.optimizer == 'sgd' else cfg.optimizer}; "
            f"executor {exp.environment['executor']}{' (auto)' if cfg.executor == 'auto' else ''}; "
            f"seed {cfg.seed}; "
            f"run directory {exp.run_dir}")


def cmd_run(args, console: Console) -> int:
    from fedskew.config import ConfigError, load_config

    if args.resume:
        if args.items:
            raise ConfigError(f"fedskew run --resume takes no config or overrides (got {' '.join(args.items)}); "
                              f"the run directory's config.yaml is used.")
        args.run_dir = args.resume
        return cmd_resume(args, console)
    config, overrides = _split_args(args.items)
    single, multi = split_multirun(overrides)
    if multi:
        if args.print_config:
            raise ConfigError(f"--print-config shows one config; {', '.join(multi)} list several values.")
        spec = multirun_spec(config, single, multi)
        out = Path(args.out) if args.out else \
            Path(spec["base"].get("out_dir", "runs")) / f"multirun-{time.strftime('%Y%m%d-%H%M%S')}"
        from fedskew.experiments.spec import load_spec

        return _run_and_report(load_spec(spec), str(out), args.jobs, True, console, args)
    if args.out:  # the run's folder itself, as --out names a folder in every other command
        out = Path(args.out)
        check_folder_name(out, "run --out")
        if out.name in ("", ".", ".."):
            raise ConfigError(f"run --out '{args.out}' must name the run's own folder (its last part is the run's "
                              f"name).")
        overrides = [*overrides, f"out_dir={out.parent}", f"run_name={out.name}"]
    cfg = load_config(config, overrides)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(full_config(cfg), sort_keys=False), end="")
        return 0
    from fedskew.engine.runner import Experiment  # (after the config: a mistake in it is said without the engine)

    exp = Experiment(cfg)
    if exp.worker:  # a rank > 0 of `torchrun ... distributed=true`: trains for rank 0, prints nothing
        exp.run()
        return 0
    console.print(_start_line(cfg, exp), highlight=False)
    args.interrupt_hint = (f"the run directory keeps the last checkpoint: `fedskew resume{_imports(args)} "
                           f"{exp.run_dir}` continues it.")
    return _execute(exp.run, cfg.rounds, console)


def split_multirun(overrides: list[str]) -> tuple[list[str], dict[str, list]]:
    """Hydra's multirun convention: ``key=a,b,c`` lists values to run each of (a value in brackets,
    braces or quotes is one value: ``model.hidden=[64,32]``). ``logger`` is a list itself:
    ``logger=tensorboard,mlflow`` is one run logging to both."""
    import yaml

    single, multi = [], {}
    for item in overrides:
        key, _, raw = item.partition("=")
        if "," in raw and key != "logger" and not raw.strip().startswith(("[", "{", "'", '"')):
            multi[key] = [yaml.safe_load(v) for v in raw.split(",")]
        else:
            single.append(item)
    return single, multi


def multirun_spec(config: str | None, single: list[str], multi: dict[str, list]) -> dict:
    """The sweep a multirun asks for: every combination of the listed values. ``method`` and its
    options become the sweep's methods and option grids, ``seed`` its seeds, ``partition.*`` its
    partitions, any other key one labelled method entry per value."""
    import itertools

    from fedskew.config import ConfigError, apply_overrides, read_config_file

    base = apply_overrides(read_config_file(config) if config else {}, single)
    method = base.pop("method", "fedavg")
    method = {"name": method} if isinstance(method, str) else dict(method)
    names = multi.pop("method", [method.pop("name", "fedavg")])
    method.pop("name", None)
    options = {**method, **{k.split(".", 1)[1]: v for k, v in multi.items() if k.startswith("method.")}}
    seeds = multi.pop("seed", [base.pop("seed", 0)])
    part_keys = [k for k in multi if k.startswith("partition.")]
    other_keys = [k for k in multi if not k.startswith(("method.", "partition."))]
    for k in other_keys:
        if k in ("out_dir", "run_name"):
            raise ConfigError(f"multirun: '{k}' takes one value, not {multi[k]}.")
    partitions = {",".join(f"{k.split('.', 1)[1]}={v}" for k, v in zip(part_keys, combo)) or "default":
                  {k.split(".", 1)[1]: v for k, v in zip(part_keys, combo)}
                  for combo in itertools.product(*(multi[k] for k in part_keys))}
    methods = []
    for name in names:
        for combo in itertools.product(*(multi[k] for k in other_keys)):
            extra = dict(zip(other_keys, combo))
            label = " ".join([name, *(f"{k}={v}" for k, v in extra.items())])
            methods.append({"name": name, "label": label, "options": options, "config": extra})
    title = " ".join(f"{k}={','.join(str(v) for v in vals)}" for k, vals in
                     [("method", names), *((k, multi[k]) for k in multi if k != "method"), ("seed", seeds)])
    return {"name": f"multirun {title}", "base": base, "methods": methods, "partitions": partitions,
            "seeds": seeds}


def full_config(cfg) -> dict:
    """The resolved config with every default, the method's options included."""
    from fedskew.algorithms import COMPONENTS, METHODS

    data = cfg.resolved()
    cls = METHODS[cfg.method.name]
    given = cfg.method.options
    method = {
        "name": cfg.method.name,
        **cls.Options(**{k: v for k, v in given.items() if k not in COMPONENTS}).model_dump(),
    }
    for name in COMPONENTS:
        if name in given:
            method[name] = COMPONENTS[name].Options(**given[name]).model_dump()
    data["method"] = method
    return data


def cmd_resume(args, console: Console) -> int:
    from fedskew.config import read_config_file
    from fedskew.engine.resume import resume

    changes = list(getattr(args, "changes", None) or [])
    record = Path(args.run_dir) / "config.yaml"
    # the progress bar's length, read without validating the config: nothing the folder names is
    # imported before resume() has shown the folder to be the run's
    data = read_config_file(record) if record.is_file() else {}
    rounds = next((c.split("=", 1)[1] for c in reversed(changes) if c.startswith("rounds=")), data.get("rounds", 0))
    rounds = int(rounds) if str(rounds).isdigit() else 0
    args.interrupt_hint = f"`fedskew resume{_imports(args)} {args.run_dir}` continues it again."
    return _execute(lambda on_round: resume(args.run_dir, on_round, changes), rounds, console)


def _imports(args) -> str:
    """The ``--import`` flags a command was given, to repeat in the command that continues it."""
    import shlex

    return "".join(f" --import {shlex.quote(m)}" for m in getattr(args, "imports", None) or [])


def _execute(fn, rounds: int, console: Console) -> int:
    progress, on_round = _progress(console, rounds)
    if progress is not None:
        with progress:
            result = fn(on_round)
    else:
        result = fn(on_round)
    if result is not None:  # (None: a worker rank of a distributed run)
        console.print(_results_table(result.summary, result.run_dir))
    return 0


def _describe(obj) -> str:
    """The first paragraph of a method's or component's docstring, as plain text."""
    import inspect

    from fedskew.algorithms import plain_text

    doc = inspect.getdoc(obj) or ""
    return plain_text(" ".join(doc.split("\n\n")[0].split()))


def cmd_methods(args, console: Console) -> int:
    from fedskew.algorithms import (
        BUILTIN,
        COMPONENTS,
        METHODS,
        allowed_values,
        family_of,
        options_reference,
        unknown_method,
    )
    from fedskew.config import ConfigError

    if args.markdown:
        print(options_reference(), end="")
        return 0
    if args.name:
        if args.name not in METHODS and args.name not in COMPONENTS:
            raise ConfigError(unknown_method(args.name) + ".")
        cls = METHODS.get(args.name) or COMPONENTS[args.name]
        console.print(f"[bold]{args.name}[/bold]: {_describe(cls)}", highlight=False)
        console.print(f"Paper: {cls.source.text()}" if cls.source else "Paper: none recorded.", highlight=False,
                      markup=False)
        table = Table("option", "default", "allowed", "meaning")
        for key, field in cls.Options.model_fields.items():
            table.add_row(f"method.{key}" if args.name in METHODS else f"method.{args.name}.{key}",
                          repr(field.get_default(call_default_factory=True)), allowed_values(field, markdown=False),
                          field.description or "")
        console.print(table)
        if args.name in METHODS:
            console.print(f"any method also takes the components {', '.join(sorted(COMPONENTS))} "
                          f"(`fedskew methods <component>`)", highlight=False)
        return 0
    families: dict[str, list[str]] = {}
    for name, cls in METHODS.items():
        families.setdefault(FAMILIES.get(family_of(cls) if name in BUILTIN else "", "Your methods"), []).append(name)
    width = max(len(n) for n in METHODS) + 2
    room = max(40, console.width - width - 4)
    for family in [*FAMILIES.values(), "Your methods"]:
        if family not in families:
            continue
        console.print(f"[bold]{family}[/bold]", highlight=False)
        for name in families[family]:
            text = _first_sentence(_describe(METHODS[name]))
            console.print(f"  {name:<{width}}{text if len(text) <= room else text[:room - 3] + '...'}",
                          highlight=False, markup=False)
    console.print(f"{len(METHODS)} methods. `fedskew methods NAME`: its paper, options and defaults.", highlight=False)
    return 0


# The method families (a class's `family`: fedskew.algorithms.family_of), in the order `fedskew methods` lists them
FAMILIES = {"base": "FedAvg", "fedmr": "FedMR", "map": "MAP (FedRS + FedPHP)",
            "neural_collapse": "Neural collapse (fixed ETF heads)", "fedka": "Forgetting (FedKA, FedNTD)",
            "drift": "Client drift and momentum", "server_opt": "Server optimisers and aggregation",
            "representation": "Representation regularisers", "personalized": "Personalised heads and models",
            "meta": "Meta-learning", "sharing": "Partial sharing and mixing",
            "classifier": "Classifier calibration", "distillation": "Distillation and shared data",
            "clustered": "Clustered FL", "hypernetwork": "Hypernetworks"}


def _first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (not one inside 'et al.' or an abbreviation)."""
    import re

    m = re.search(r"(?<!et al)(?<!\be\.g)(?<!\bi\.e)(?<!\bEq)(?<!\bvs)(?<!\bSec)(?<!\bFig)\.(\s|$)", text)
    return text[:m.start() + 1] if m else text


def cmd_partition(args, console: Console) -> int:
    from fedskew.config import load_config
    from fedskew.data import load_federation

    config, overrides = _split_args(args.items)
    cfg = load_config(config, overrides)
    fed = load_federation(cfg)
    table = Table(title=f"{cfg.dataset.name} / {cfg.partition.name}: {fed.num_clients} clients "
                        f"(seed {cfg.seed})")
    for col in ("client", "train", "local test", "classes", "counts per class"):
        table.add_column(col)
    for row in fed.summary_rows():
        table.add_row(str(row["client"]), str(row["train"]), str(row["local_test"]),
                      str(len(row["classes"])), " ".join(f"{c}:{n}" for c, n in row["counts"].items()))
    console.print(table)
    out = Path(args.out) if args.out else \
        Path(cfg.out_dir) / f"partition-{cfg.dataset.name}-{cfg.partition.name}-s{cfg.seed}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    from fedskew.engine.durable import save_png

    save_png(fed.heatmap(), out, dpi=110)
    console.print(f"heatmap written to {out}")
    return 0


class SweepDisplay:
    """A sweep's progress (runs done / running / failed, rounds across every worker, elapsed time,
    an ETA from the measured round rate): a rich bar on a terminal, else a plain progress line
    when :meth:`SweepProgress.line_due`; and one short line per finished run."""

    def __init__(self, console: Console, total: int, rounds_per_run: float):
        from fedskew.experiments.sweep import SweepProgress, progress_line

        self.console, self.line = console, progress_line
        self.tracker = SweepProgress(total, rounds_per_run)
        self.t0 = self.tracker.t0
        self.started: dict[str, float] = {}
        self.progress = None
        if console.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn

            self.progress = Progress(BarColumn(), TextColumn("{task.description}"), console=console,
                                     refresh_per_second=2)
            self.task = self.progress.add_task(progress_line(self.tracker.snapshot()), total=self.tracker.rounds)

    def __call__(self, kind: str, r: dict) -> None:
        name = f"{r['label']}{''.join(f' {k}={v}' for k, v in r['params'].items())} {r['partition']} s{r['seed']}"
        now = time.perf_counter()
        if kind == "started":
            self.started[r["run_id"]] = now
        took = now - self.started.pop(r["run_id"], now) if kind in ("done", "failed") else 0.0
        snap = self.tracker.update(kind, r)
        line = None
        if kind == "done":
            acc = r["summary"].get("global/test_acc_mean_last10")
            pers = r["summary"].get("personal/final_acc_after")
            pers = r["summary"].get("personal/acc_after") if pers is None else pers
            shown = " ".join(f"{k} {_pct(v)}" for k, v in (("global", acc), ("personal", pers)) if v is not None)
            line = f"{name}: {shown or 'no accuracy in its summary'} ({took:.0f}s)"
        elif kind == "failed":
            line = f"{name}: FAILED ({r['error'][:200]})"
        if self.progress is not None:
            if line:
                self.progress.console.print(line, highlight=False, markup=False)
            self.progress.update(self.task, completed=snap["rounds_done"], description=self.line(snap))
            if kind != "round":  # a run started, finished or failed: drawn now, not at the next refresh tick
                self.progress.refresh()
            return
        if kind == "skipped":
            line = f"{name}: already done"
        if line:
            self.console.print(f"[{snap['runs_done']}/{snap['runs_total']}] {line}", highlight=False, markup=False,
                               soft_wrap=True)
        if self.tracker.line_due(kind):
            self.console.print(f"progress: {self.line(snap)}", highlight=False, markup=False, soft_wrap=True)


def _pct(v) -> str:
    return "none" if v is None else f"{100 * v:.2f}%"


def _sweep_tables(sweep_dir: Path, console: Console) -> None:
    """The report's main tables as terminal tables, titled with the metric and its unit."""

    from fedskew.experiments.report import (
        MIN_BOLD_SEEDS,
        build_table,
        cell_text,
        chance_of,
        default_metric,
        metric_title,
    )
    from fedskew.experiments.selection import selected_runs
    from fedskew.experiments.spec import read_record
    from fedskew.experiments.store import open_sweep

    spec = read_record(sweep_dir)
    opts = spec.get("report") or {}
    db = open_sweep(sweep_dir)
    try:
        res = selected_runs(db, spec)
    finally:
        db.close()
    metric = opts.get("metric") or default_metric(res)
    n = max((len(v) for v in res.runs.values()), default=0)
    for key in dict.fromkeys([metric, metric.removesuffix("_mean_last10"), "personal/final_acc_after"]):
        cells = {(p, c): [r.summary.get(key) for r in runs] for (c, p), runs in res.runs.items()}
        if not any(v is not None for vals in cells.values() for v in vals):
            continue
        title, scale, unit = metric_title(key)
        dataset = next((r.summary.get("dataset") for runs in res.runs.values() for r in runs), None)
        table = build_table(cells, res.partitions, res.labels, None, chance_of(dataset, key))
        bold = any(table[p][c]["top"] for p in res.partitions for c in res.labels)
        how = (f"mean +- std over {n} seeds" + (" (bold: the top group, down from the best mean to the first the "
                                                 "paired t-test over seeds finds worse)" if bold else "")
               + ("; fewer than three seeds, so nothing is bold" if 1 < n < MIN_BOLD_SEEDS else "") if n > 1
               else "one seed: no spread, so nothing is bold")
        console.print(f"\n[bold]{title}{unit}[/bold]: {key}, {how}", highlight=False)
        out = Table()
        out.add_column("partition")
        for c in res.labels:
            out.add_column(c, justify="right")
        for p in res.partitions:
            row = []
            for c in res.labels:
                text = cell_text(table[p][c], scale, res.failed.get((c, p), 0))
                row.append(re.sub(r"\*\*(.+)\*\*", r"[bold]\1[/bold]", text))  # the report's bold, in rich markup
            out.add_row(p, *row)
        console.print(out)


def _run_and_report(spec, out: str | None, jobs: int | None, report: bool, console: Console, args=None,
                    ray: str | None = None) -> int:
    from fedskew.experiments.pool import check_pack

    pack = check_pack(getattr(args, "pack", None) or "auto")  # (a bad value: one sentence before anything runs)
    from fedskew.config import ConfigError
    from fedskew.experiments.report import write_report
    from fedskew.experiments.spec import MAX_RUNS, default_jobs, default_sweep_dir, planned_count, rounds_per_run
    from fedskew.experiments.store import writable
    from fedskew.experiments.sweep import clock, run_sweep

    sweep_dir = Path(out) if out else default_sweep_dir(spec)
    check_folder_name(sweep_dir, "--out")
    total = planned_count(spec)
    jobs = jobs or default_jobs()
    where = (f"{jobs} at a time" if ray is None else
             f"on Ray ({'a local instance' if ray == 'local' else ray}; {spec.resources.num_cpus:g} CPU, "
             f"{spec.resources.num_gpus:g} GPU per run)")
    console.print(f"fedskew sweep '{spec.name}': {len(spec.methods)} methods x {len(spec.partitions)} partitions x "
                  f"{len(spec.seeds)} seeds = {total} runs (grids included"
                  + (f"; each grid on seeds {spec.selection.tune_seeds}, its chosen point on the others"
                     if spec.selection.tune_seeds is not None else "") + f") into {sweep_dir}, {where}",
                  highlight=False)
    if total > MAX_RUNS and not getattr(args, "yes", False):
        raise ConfigError(f"the sweep plans {total:,} runs, more than {MAX_RUNS:,}, so nothing was started; check its "
                          f"grids and seeds, or add --yes to run them all.")
    if args is not None:  # (a multirun names a new folder each time: its continuation is named explicitly)
        on = f"--ray {ray}" if ray is not None else f"--jobs {jobs}"
        again = (f"`fedskew sweep {sweep_dir / 'sweep.yaml'} --out {sweep_dir} {on}`"
                 if args.command in ("run", "sweep") else "the same command again")
        args.interrupt_hint = (f"finished runs are kept in {sweep_dir} (interrupted ones with their checkpoints); "
                               f"{again} continues the sweep.")
    display = SweepDisplay(console, total, rounds_per_run(spec))
    if display.progress is not None:
        with display.progress:
            db = run_sweep(spec, sweep_dir, jobs, display, ray, pack)
    else:
        db = run_sweep(spec, sweep_dir, jobs, display, ray, pack)
    failed = db.execute("SELECT COUNT(*) FROM runs WHERE status='failed'").fetchone()[0]
    db.close()
    console.print(f"{total} runs, {failed} failed; results in {sweep_dir / 'results.sqlite'} "
                  f"({clock(time.perf_counter() - display.t0)})", highlight=False)
    if report and not writable(sweep_dir):
        _sweep_tables(sweep_dir, console)
        console.print(f"{sweep_dir} is read-only, so no report is written there; `fedskew report {sweep_dir} --out "
                      f"DIR` writes one elsewhere.", highlight=False)
    elif report:
        md, page = write_report(sweep_dir)
        _sweep_tables(sweep_dir, console)
        console.print(f"report: {md} and {page}", highlight=False)
    return 1 if failed else 0


def cmd_sweep(args, console: Console) -> int:
    from fedskew.config import ConfigError
    from fedskew.experiments.presets import default_comparison
    from fedskew.experiments.spec import load_spec

    spec = load_spec(args.file if args.file else default_comparison())
    if args.ray_cpus is not None or args.ray_gpus is not None:
        if args.ray is None:
            raise ConfigError("--ray-cpus and --ray-gpus ask Ray for resources; add --ray [ADDRESS].")
        update = {k: v for k, v in (("num_cpus", args.ray_cpus), ("num_gpus", args.ray_gpus)) if v is not None}
        spec = load_spec({**spec.model_dump(), "resources": {**spec.resources.model_dump(), **update}})
    if args.ray is not None and args.jobs:
        raise ConfigError("--jobs sets local worker processes; with --ray the cluster's resources decide "
                          "(--ray-cpus, --ray-gpus).")
    return _run_and_report(spec, args.out, args.jobs, not args.no_report, console, args, args.ray)


def cmd_reproduce(args, console: Console) -> int:
    from fedskew.experiments.presets import reproduction
    from fedskew.experiments.spec import load_spec

    spec = load_spec(reproduction(args.name, args.scale, args.data))
    scale = "lite" if args.scale == "small" else args.scale
    out = args.out or str(Path("runs") / f"reproduce-{args.name}-{scale}")
    if args.scale == "smoke":
        console.print("smoke test: the paper's pipeline on the bundled digits for a few rounds and one seed; it checks "
                      "that everything runs and says nothing about the methods (--scale lite or paper measures "
                      "them).", highlight=False)
    return _run_and_report(spec, out, args.jobs, True, console, args)


def _csv(value: str | None) -> list[str] | None:
    return None if not value else [v.strip() for v in value.split(",") if v.strip()]


def _bench_list(console: Console) -> int:
    """``fedskew bench --list``: every suite with its runs, linked published values and time per scale."""
    from fedskew.experiments import bench

    table = Table("suite", "scale", "runs", "published linked", "time (estimate)", title="fedskew bench suites")
    rows = bench.listing()
    for row in rows:
        table.add_row(row["suite"], row["scale"], str(row["runs"]), str(row["published"]), row["time"])
    console.print(table)
    for name in dict.fromkeys(row["suite"] for row in rows):
        row = next(r for r in rows if r["suite"] == name)
        console.print(f"{name} ({row['papers']}): {row['about']}", highlight=False)
    console.print("`fedskew bench SUITE --scale smoke|lite|paper [--data DIR] [--jobs N | --ray ADDRESS]` runs a "
                  "suite; `--report` rebuilds its leaderboard from the runs it has.", highlight=False)
    return 0


def cmd_bench(args, console: Console) -> int:
    from fedskew.config import ConfigError
    from fedskew.experiments import bench
    from fedskew.experiments.spec import load_spec

    if args.list or args.suite is None:
        return _bench_list(console)
    bench.check_suite(args.suite, args.scale or "smoke")  # the suite's name first
    if args.methods:
        from fedskew.algorithms import did_you_mean, registered

        unknown = [m for m in _csv(args.methods) or [] if m not in registered()]
        if unknown:
            raise ConfigError(f"bench --methods names {unknown[0]!r}, which is not a registered method"
                              f"{did_you_mean(unknown[0], registered())}; `fedskew methods` lists them (a method of "
                              f"your own: --import MODULE, the module that registers it).")
    if args.scale is None:
        raise ConfigError(f"bench {args.suite} needs --scale smoke, lite or paper (`fedskew bench --list` gives the "
                          f"runs and the time of each).")
    bench.check_suite(args.suite, args.scale)
    from fedskew.experiments.published import load as load_registry

    load_registry()  # a broken published-results file is one sentence before anything trains
    for flag in ("parts", "seeds", "settings"):
        if getattr(args, flag, None) is not None and not _csv(getattr(args, flag)):
            raise ConfigError(f"bench --{flag} '{getattr(args, flag)}' names nothing; give comma-separated names, or "
                              f"leave the flag out for all.")
    if args.scale != "smoke" and not args.data and not args.report:
        raise ConfigError(f"bench --scale {args.scale} reads Fashion-MNIST (and CIFAR-10 at paper scale) from disk: "
                          f"give the folder with --data DIR.")
    methods = None
    if args.methods:
        from fedskew.algorithms import did_you_mean, registered

        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in methods if m not in registered()]
        if unknown:
            raise ConfigError(f"bench --methods names {unknown[0]!r}, which is not a registered method"
                              f"{did_you_mean(unknown[0], registered())}; `fedskew methods` lists them (a method of "
                              f"your own: --import MODULE, the module that registers it).")
    folder = bench.suite_dir(args.suite, args.scale, args.out)
    check_folder_name(folder, "bench --out")
    bench.claim_folder(folder, args.suite, args.scale, write=False)  # one suite and scale per folder
    failed = 0
    if args.strict and not args.report:  # refused before anything trains, not after every run

        from fedskew.engine.rundir import git_commit

        here = git_commit() or os.environ.get("FEDSKEW_GIT_COMMIT") or f"version {__version__}"
        others = sorted(set(bench.code_of_runs(args.suite, folder, methods)) - {here})
        why = (f"this checkout has uncommitted changes ({here})" if here.endswith("+dirty") else
               f"the folder holds runs of {', '.join(others[:3])} and this checkout is {here}" if others else None)
        if why:
            raise ConfigError(f"bench --strict: {why}, so the board's runs would not come from one clean commit; "
                              f"nothing was trained (commit first, or leave --strict out).")
    if not args.report:
        parts = bench.sweeps(args.suite, args.scale, args.data, methods)
        if not parts:
            raise ConfigError(f"bench suite '{args.suite}' has none of the methods {methods} at scale {args.scale}.")
        parts = bench.restrict(parts, args.suite, _csv(args.parts), _csv(args.seeds),
                               {"device": args.device, "executor": args.executor,
                                "checkpoint_every": args.checkpoint_every}, _csv(args.settings))
        bench.claim_folder(folder, args.suite, args.scale)
        for paper, spec in parts.items():
            failed |= _run_and_report(load_spec(spec), str(folder / bench.part_folder(paper, args.scale)), args.jobs,
                                      False, console, args, args.ray)
    else:
        if args.settings or args.parts or args.seeds:  # their names are checked as a run checks them
            bench.restrict(bench.sweeps(args.suite, args.scale, args.data, methods), args.suite, _csv(args.parts),
                           _csv(args.seeds), {}, _csv(args.settings))
        bench.check_has_runs(folder, args.suite, args.scale)  # nothing to rank: no empty board is written
    # the board names the data folder DATA_DIR: where the data lay on the machine that built it is no reader's path
    command = f"fedskew bench {args.suite} --scale {args.scale}" + (" --data DATA_DIR" if args.data else "") + \
        "".join(f" --import {m}" for m in getattr(args, "imports", None) or []) + \
        (f" --methods {','.join(methods)}" if methods else "") + \
        "".join(f" --{k} {shlex.quote(v)}" for k, v in (("parts", args.parts), ("seeds", args.seeds),
                                                        ("settings", args.settings)) if v)
    md, page, cells, said = bench.write_leaderboard(args.suite, args.scale, command, folder, methods,
                                                    strict=args.strict, beside_board=args.beside)
    if cells:
        table = Table("paper", "table", "setting", "method", "ours", "published", "delta", "within",
                      title=f"fedskew bench {args.suite} ({args.scale}): ours beside the published numbers")
        for c in cells:
            ours = "not run" if c.mean is None else f"{c.mean:.2f}" + (f" +- {c.std:.2f}" if c.std is not None else "")
            table.add_row(c.paper, c.entry.source.table, c.entry.setting_id, c.entry.method, ours,
                          f"{c.entry.value:.2f}", "-" if c.delta is None else f"{c.delta:+.2f}",
                          "-" if c.within is None else ("yes" if c.within else "no"))
        console.print(table)
    note = bench.SCALE_NOTE[args.scale] if cells else bench.label_skew_note(args.scale)
    for line in said:  # (--beside: does this board's baseline reproduce the committed one's?)
        console.print(line, highlight=False)
    console.print(f"{note}.\nleaderboard: {md} and {page}", highlight=False)
    return 1 if failed else 0


def cmd_report(args, console: Console) -> int:
    from fedskew.experiments.report import write_report

    if args.out:
        check_folder_name(args.out, "report --out")
    md, page = write_report(args.sweep_dir, args.out, args.metric, args.baseline)
    console.print(f"report: {md} and {page}", highlight=False)
    return 0


def _flower():
    try:
        import fedskew.flower as fl
        import fedskew.flower.app  # noqa: F401  (needs flwr: the one-sentence error below)
    except ImportError as exc:
        from fedskew.config import ConfigError

        raise ConfigError(str(exc)) from None
    return fl


def cmd_flower(args, console: Console) -> int:
    import subprocess

    from fedskew.config import ConfigError, load_config
    from fedskew.engine.rundir import default_run_dir

    fl = _flower()
    config, overrides = _split_args(args.items)
    cfg = load_config(config, overrides)
    fl.check_supported(cfg)
    run_dir = Path(args.out) if args.out else default_run_dir(cfg)
    if args.action == "simulate":
        summary = fl.simulate(cfg, run_dir)
        console.print(_results_table(summary, run_dir))
        return 0
    app_dir = Path(args.app_dir) if args.app_dir else run_dir / "flower-app"
    fl.write_app(cfg, app_dir, str(run_dir.resolve()), args.timeout)
    if args.action == "app":
        console.print(f"Flower app written to {app_dir}; run it with `flwr run {app_dir} <connection>` "
                      f"(its ServerApp writes the run directory {run_dir.resolve()} on the SuperLink's machine).",
                      highlight=False)
        return 0
    if not args.superlink:
        raise ConfigError("fedskew flower run needs --superlink HOST:PORT (the SuperLink's address).")
    home = run_dir / "flwr-home"
    fl.write_connection(home, args.superlink, insecure=args.root_certificates is None,
                        root_certificates=args.root_certificates)
    transport = {"superlink": args.superlink, "tls": args.root_certificates is not None,
                 "root_certificates": args.root_certificates}
    (run_dir / "flower-connection.json").write_text(json.dumps(transport, indent=2))
    if args.root_certificates is None:
        console.print(f"fedskew: the connection to {args.superlink} is INSECURE (no TLS: models and updates travel in "
                      f"clear); pass --root-certificates CA.pem for a TLS SuperLink (docs/flower.md, \"Security\"). "
                      f"Recorded in {run_dir / 'flower-connection.json'}.", highlight=False)
    env = fl.flower_env(FLWR_HOME=str(home.resolve()))
    console.print(
        f"fedskew {__version__}: {cfg.method.name} on Flower at {args.superlink}, "
        f"{cfg.partition.num_clients} SuperNodes expected; run directory {run_dir.resolve()}",
        highlight=False,
    )
    done = subprocess.run(["flwr", "run", str(app_dir), "fedskew", "--stream"], env=env)  # flwr found via env PATH
    summary_path = run_dir / "summary.json"
    if done.returncode != 0 or not summary_path.is_file():
        console.print(f"the Flower run did not finish (flwr exit code {done.returncode}); the ServerApp's log is "
                      f"above; no {summary_path} was written here (it is written on the SuperLink's machine).",
                      highlight=False)
        return 1
    from fedskew.experiments.store import clean_metrics
    from fedskew.files import read_json

    summary = read_json(summary_path, "run summary", own=True)
    console.print(_results_table(clean_metrics(summary) if isinstance(summary, dict) else {}, run_dir))
    return 0


IMPORT_HELP = ("import a module (a name on the Python path, or a .py file) first: the methods it registers with "
               "fedskew.register_method can be named like built-in ones; repeat for several")
YES_HELP = "run a sweep of more than 10,000 runs (refused without it: a typo in a grid should not start a week of work)"
PACK_HELP = ("runs on the vectorised executor that differ only in seed, partition, lr or float method options train "
             "as lanes of one program (docs/design.md, \"Runs as lanes\"): auto (on a CUDA device; default), off, or N "
             "runs a pack")


def _import_and_yes(parser: argparse.ArgumentParser) -> None:
    """--import and --yes, which every command that starts runs takes."""
    parser.add_argument("--import", dest="imports", action="append", metavar="MODULE", help=IMPORT_HELP)
    parser.add_argument("--yes", action="store_true", help=YES_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedskew", description="Federated learning under label skew.",
                                     epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"fedskew {__version__}")
    sub = parser.add_subparsers(dest="command")
    p_run = sub.add_parser("run", help="run one experiment", epilog=EPILOG)
    p_run.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value]")
    p_run.add_argument("--resume", metavar="RUN_DIR", help="continue the interrupted run in RUN_DIR")
    p_run.add_argument("--out", metavar="DIR", help="the run's folder (the same as out_dir=PARENT run_name=NAME; "
                                                   "default out_dir/<method>-<dataset>-<partition>-s<seed>-<time>); "
                                                   "with several values (key=a,b), the sweep's folder")
    p_run.add_argument("--print-config", action="store_true",
                       help="print the resolved config (every default, the method's options included) and exit")
    p_run.add_argument("--jobs", type=int, help="multirun (key=a,b): runs at once (default: min(2, cores))")
    p_run.add_argument("--pack", metavar="auto|off|N", help=PACK_HELP)
    _import_and_yes(p_run)
    p_res = sub.add_parser("resume", help="continue an interrupted run from its directory")
    p_res.add_argument("run_dir")
    p_res.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                       help=IMPORT_HELP + " (a run of your own method needs it again: a run folder never imports code)")
    p_res.add_argument("changes", nargs="*", metavar="key=value",
                       help="settings to change from the next round on (lr, lr_decay, grad_clip, rounds, ...)")
    p_part = sub.add_parser("partition", help="print and draw a partition", epilog=EPILOG)
    p_part.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value]")
    p_part.add_argument("--out", help="heatmap PNG path (default OUT_DIR/partition-<dataset>-<partition>-s<seed>.png)")
    p_meth = sub.add_parser("methods", help="every method with its options, defaults and description")
    p_meth.add_argument("name", nargs="?", help="one method: its options with their descriptions")
    p_meth.add_argument("--markdown", action="store_true", help="every method's and component's options as Markdown "
                                                                "(docs/methods.md, \"Options reference\")")
    p_sw = sub.add_parser("sweep", help="methods x options x partitions x seeds into a results database and a "
                                         "report (no file: FedAvg vs the four seed methods on digits)")
    p_sw.add_argument("file", nargs="?", help="sweep YAML (see src/fedskew/experiments/sweep.py)")
    p_sw.add_argument("--out", help="sweep folder (default runs/sweep-<name>); running again resumes it")
    p_sw.add_argument("--jobs", type=int, help="runs at once, one torch thread each (default: min(2, cores))")
    p_sw.add_argument("--no-report", action="store_true", help="skip the report at the end")
    p_sw.add_argument("--pack", metavar="auto|off|N", help=PACK_HELP)
    _import_and_yes(p_sw)
    p_sw.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                      help="run on Ray: no address starts a local instance; auto, host:port or ray://host:10001 "
                           "joins a cluster (docs/scaling.md)")
    p_sw.add_argument("--ray-cpus", type=float, help="CPUs per run on Ray (default 1; sweep key resources.num_cpus)")
    p_sw.add_argument("--ray-gpus", type=float, help="GPUs per run on Ray, fractions allowed (default 0)")
    p_rep = sub.add_parser("report", help="tables and plots of a sweep folder as Markdown and HTML")
    p_rep.add_argument("sweep_dir")
    p_rep.add_argument("--out", help="report folder (default SWEEP_DIR/report)")
    p_rep.add_argument("--metric", help="main metric (default global/test_acc_mean_last10, or the personalised "
                                        "accuracy where no run has a global model)")
    p_rep.add_argument("--baseline", help="the method gains are measured against (default fedavg)")
    p_pro = sub.add_parser("reproduce", help="a seed paper's main table at smoke, lite or paper scale")
    p_pro.add_argument("name", help="fedmr, map, etf or fedka")
    p_pro.add_argument("--scale", default="smoke", help="smoke (digits, CI), lite (Fashion-MNIST, < 1 h on a CPU) "
                                                       "or paper")
    p_pro.add_argument("--data", help="folder holding the data set (lite and paper scales)")
    p_pro.add_argument("--out", help="sweep folder (default runs/reproduce-<name>-<scale>)")
    p_pro.add_argument("--jobs", type=int, help="runs at once, one torch thread each (default: min(2, cores))")
    p_pro.add_argument("--pack", metavar="auto|off|N", help=PACK_HELP)
    p_be = sub.add_parser("bench", help="a benchmark suite of the papers' settings, with the published numbers "
                                         "beside ours (`fedskew bench --list`)")
    p_be.add_argument("suite", nargs="?", help="the suite (fedskew bench --list)")
    p_be.add_argument("--list", action="store_true", help="the suites with their size at each scale")
    p_be.add_argument("--scale", help="smoke (digits, seconds a cell), lite (Fashion-MNIST at CPU scale) or paper; "
                                      "required to run a suite")
    p_be.add_argument("--data", help="folder holding the data sets (lite and paper scales)")
    p_be.add_argument("--out", help="suite folder (default runs/bench-<suite>-<scale>); running again resumes it")
    p_be.add_argument("--jobs", type=int, help="runs at once, one torch thread each (default: min(2, cores))")
    p_be.add_argument("--pack", metavar="auto|off|N", help=PACK_HELP)
    _import_and_yes(p_be)
    p_be.add_argument("--ray", help="run on Ray (local, auto, host:port)")
    p_be.add_argument("--report", action="store_true", help="only rebuild the leaderboard from the runs there are")
    p_be.add_argument("--strict", action="store_true", help="refuse a leaderboard whose runs come from more than one "
                                                            "commit or from a tree with uncommitted changes")
    p_be.add_argument("--methods", help="only these methods (comma-separated names)")
    p_be.add_argument("--beside", metavar="BOARD.md",
                      help="put a committed board's rows beside this board's, ranked again with them "
                           "(docs/leaderboards/label-skew-lite.md: your method among the methods it ranks, "
                           "without running them), "
                           "and say how far the two rank the methods both ran alike (Kendall's tau-b)")
    p_be.add_argument("--parts", help="only these parts of the suite (comma-separated; `fedskew bench --list` names "
                                      "them), e.g. map")
    p_be.add_argument("--seeds", help="only these of the suite's seeds (comma-separated), e.g. 0")
    p_be.add_argument("--settings", help="only these settings (the tables' columns, comma-separated), e.g. '#C=2'")
    p_be.add_argument("--device", help="where the runs train (cpu, cuda, cuda:N); not part of the setting")
    p_be.add_argument("--executor", choices=["sequential", "vectorized"],
                      help="the executor of every run (the two agree to float round-off); not part of the setting")
    p_be.add_argument("--checkpoint-every", type=int, metavar="N",
                      help="write every run's checkpoint every N rounds (a crash resumes from up to N-1 rounds "
                           "back); stateful methods at paper scale write hundreds of MiB a checkpoint; not part of "
                           "the setting")
    p_fl = sub.add_parser("flower", help="run a config on Flower: simulation, app export, or a running SuperLink",
                          epilog=EPILOG)
    p_fl.add_argument("action", choices=["simulate", "app", "run"],
                      help="simulate: Flower's simulation runtime; app: write a Flower app directory for `flwr run`; "
                           "run: write it and run it against --superlink")
    p_fl.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value]")
    p_fl.add_argument("--out", help="run directory (default runs/<method>-...)")
    p_fl.add_argument("--app-dir", help="where to write the Flower app (default RUN_DIR/flower-app)")
    p_fl.add_argument("--superlink", help="run: the SuperLink's address HOST:PORT")
    p_fl.add_argument("--root-certificates", help="run: CA certificate (PEM) of a TLS SuperLink (default: insecure)")
    p_fl.add_argument("--timeout", type=float, default=600.0, help="seconds a round waits for a SuperNode's reply")
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C: the run stops with its last checkpoint and the resume command."""


_SIGNALLED: str | None = None  # "interrupted" or "terminated" once SIGINT or SIGTERM arrived during main()


def _signalled(kind: str) -> None:
    """Remember the signal, and ask a run in progress to stop after its round (``durable.STOP``) as well: Python
    swallows a KeyboardInterrupt raised inside a weakref callback or a ``__del__`` ("Exception ignored in ...";
    found by signalling runs at random moments: the run went on and ended with exit 0)."""
    global _SIGNALLED
    _SIGNALLED = kind
    durable = sys.modules.get("fedskew.engine.durable")  # (loaded with any run; nothing is imported in a handler)
    if durable is not None:
        durable.STOP.set()


def _on_sigterm(signum, frame):
    _signalled("terminated")
    raise Terminated()


def _on_sigint(signum, frame):
    _signalled("interrupted")
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    import signal

    global _SIGNALLED
    _SIGNALLED = None
    if "fedskew.engine.durable" in sys.modules:  # (a second command in one process starts afresh)
        sys.modules["fedskew.engine.durable"].STOP.clear()
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    if before[0] is signal.SIG_DFL:  # not inside a host that handles it
        signal.signal(signal.SIGTERM, _on_sigterm)
    if before[1] is signal.default_int_handler:  # Python's own: the same KeyboardInterrupt, remembered
        signal.signal(signal.SIGINT, _on_sigint)
    hook = sys.unraisablehook
    sys.unraisablehook = _unraisable
    try:
        return _main(argv)
    except KeyboardInterrupt as exc:  # before a command began: while Python imported the libraries it needs
        return _stopped(None, isinstance(exc, Terminated))
    except Exception as exc:
        if _SIGNALLED is None:
            if os.environ.get("FEDSKEW_DEBUG", "") not in ("", "0"):
                raise
            return crashed(exc, argv)
        global _END_NOW
        _END_NOW = True  # (as in _main: an exception that stands for the signal)
        return _stopped(None, _SIGNALLED == "terminated")
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])
        sys.unraisablehook = hook


def crashed(exc: BaseException, argv: list[str] | None) -> int:
    """The error boundary: an exception no command anticipated is one sentence on stderr (what failed,
    on which file where it names one) and the path of a crash report that holds the traceback; exit
    status 1. ``FEDSKEW_DEBUG=1`` raises it instead."""
    import tempfile
    import traceback

    command = " ".join(["fedskew", *(sys.argv[1:] if argv is None else argv)])
    report = None
    try:
        fd, report = tempfile.mkstemp(prefix="fedskew-crash-", suffix=".txt")
        with os.fdopen(fd, "w") as fh:
            fh.write(f"{command}\n\n{''.join(traceback.format_exception(exc))}")
    except OSError:
        report = None
    what = (str(exc).splitlines() or [""])[0][:200] or "no message"
    where = f" on '{exc.filename}'" if isinstance(exc, OSError) and exc.filename else ""
    kept = (f"the traceback is in {report}" if report else "no crash report could be written") + \
        "; FEDSKEW_DEBUG=1 prints it here instead"
    print(f"fedskew: error: {command.split(' ', 2)[1] if ' ' in command else 'fedskew'} failed{where} with an "
          f"unexpected {type(exc).__name__} ({what}); {kept}.", file=sys.stderr)
    return 1


def _unraisable(unraisable) -> None:
    """A signal's KeyboardInterrupt that Python could not raise (it arrived in a weakref callback or a
    ``__del__``) is not printed as "Exception ignored" with a traceback: the run stops after its round."""
    if not (isinstance(unraisable.exc_value, KeyboardInterrupt) and _SIGNALLED is not None):
        sys.__unraisablehook__(unraisable)


def _one_line_warnings() -> None:
    """fedskew's own deprecation notices (FutureWarning) and inert-option warnings as one line on
    stderr, not Python's format."""
    import warnings

    from fedskew.config import InertOptionWarning

    default, seen = warnings.showwarning, set()

    def show(message, category, filename, lineno, file=None, line=None):
        if (issubclass(category, FutureWarning) and "fedskew" in str(message)) or issubclass(
            category, InertOptionWarning
        ):
            if str(message) not in seen:  # (a config is validated more than once)
                seen.add(str(message))
                print(f"fedskew: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)
    warnings.showwarning = show


def _config_flag(argv: list[str], unknown: list[str]) -> str | None:
    """One sentence for a run setting written as a flag (``--rounds 5``): settings are config keys."""
    from fedskew.config import RunConfig

    for flag in unknown:
        if not flag.startswith("--"):
            continue
        key, _, value = flag[2:].partition("=")
        key = key.replace("-", "_")
        if key.split(".")[0] not in RunConfig.model_fields:
            continue
        if not value and flag in argv and argv.index(flag) + 1 < len(argv):
            nxt = argv[argv.index(flag) + 1]
            value = nxt if not nxt.startswith("-") and "=" not in nxt else ""
        return (f"'{flag}' is not a flag: a run's settings are config keys, written {key}={value or 'VALUE'} "
                f"(`fedskew run --print-config` lists them).")
    return None


COMMANDS = ("run", "resume", "partition", "methods", "sweep", "report", "reproduce", "bench", "flower")


def _unknown_command(argv: list[str]) -> str | None:
    """The sentence for a first word that is no command (argparse lists the choices, and suggests
    none before Python 3.14)."""
    import difflib

    word = next((a for a in argv if not a.startswith("-")), None)
    if word is None or word in COMMANDS or "=" in word or argv.index(word) > 0:
        return None
    near = difflib.get_close_matches(word, COMMANDS, n=1, cutoff=0.6)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    return (f"'{word}' is not a command{hint}; the commands: {', '.join(COMMANDS)} (`fedskew --help` says what each "
            f"does).")


def _main(argv: list[str] | None) -> int:
    said = _unknown_command(list(sys.argv[1:] if argv is None else argv))
    if said:
        print(f"fedskew: error: {said}", file=sys.stderr)
        return 2
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        said = _config_flag(list(sys.argv[1:] if argv is None else argv), unknown)
        if said:
            print(f"fedskew: error: {said}", file=sys.stderr)
            return 2
        parser.parse_args(argv)  # argparse's own message and exit status for anything else
    import gc
    import os

    import torch  # noqa: F401  (every command imports it, through the config)

    # torch's import leaves about half a million objects that live as long as the process; frozen, the
    # garbage collector's full passes stop scanning them, Python's last one at exit included (a listing or
    # a typo answers about 0.45 s sooner: benchmarks/feedback_speed.py, docs/performance.md)
    gc.freeze()
    _one_line_warnings()
    # piped output (a log file, CI) gets 120 columns rather than rich's 80, so result tables do not wrap
    console = Console() if sys.stdout.isatty() or "COLUMNS" in os.environ else Console(width=120)
    commands = {"run": cmd_run, "resume": cmd_resume, "partition": cmd_partition, "sweep": cmd_sweep,
                "methods": cmd_methods, "bench": cmd_bench,
                "report": cmd_report, "reproduce": cmd_reproduce, "flower": cmd_flower}
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return _dispatch(args, console, commands)
    except Exception:
        if _SIGNALLED is None:
            raise
        # the signal landed where its KeyboardInterrupt became another exception: a C extension's import
        # (matplotlib's ft2font gives "ImportError: initialization failed", found by signalling runs at random
        # moments) or a callback from C; or Python swallowed it and the run stopped after its round (STOP:
        # RunInterrupted). It is the interruption; a half-initialised extension may crash the interpreter's
        # shutdown, so the process ends at once.
        global _END_NOW
        _END_NOW = True
        return _stopped(args, _SIGNALLED == "terminated")


def _stopped(args, terminated: bool) -> int:
    """The interruption's sentence (with the command that continues, where there is one) and exit status."""
    hint = getattr(args, "interrupt_hint", None)
    print(f"\nfedskew: {'terminated' if terminated else 'interrupted'}{'; ' + hint if hint else '.'}", file=sys.stderr)
    return 143 if terminated else 130


def _dispatch(args, console, commands) -> int:
    from fedskew.config import ConfigError
    from fedskew.data import DatasetError, PartitionError
    from fedskew.models import ModelError

    def said() -> tuple[type[BaseException], ...]:
        """The errors said in one sentence; a client's failure only where the engine ran (a command that
        lists or checks something never imports it)."""
        runner = sys.modules.get("fedskew.engine.runner")
        return ConfigError, DatasetError, PartitionError, ModelError, FloatingPointError, \
            *((runner.ClientFailure,) if runner is not None else ())

    try:
        import_user_modules(getattr(args, "imports", None) or [])
        return commands[args.command](args, console)
    except said() as exc:
        print(f"fedskew: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a read-only folder or a full disk anywhere else: one sentence, nothing half-written
        from fedskew.engine.rundir import STORAGE_ERRNOS

        if exc.errno not in STORAGE_ERRNOS:
            raise
        where = f" '{exc.filename}'" if exc.filename else ""
        print(f"fedskew: error: cannot write{where} ({exc.strerror or exc}); free space or choose a writable folder, "
              f"then run the same command again: finished work is kept.", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        global _END_NOW
        _END_NOW = bool(getattr(args, "interrupt_hint", None))  # an interrupted sweep: its database is written
        return _stopped(args, isinstance(exc, Terminated) or _SIGNALLED == "terminated")  # and its workers are gone


_END_NOW = False


def check_folder_name(path, flag: str) -> None:
    """One sentence for a folder name the file system cannot hold (a part over 255 bytes)."""
    from fedskew.config import ConfigError

    long = [part for part in Path(str(path)).parts if len(part.encode()) > 255]
    if long:
        raise ConfigError(
            f"{flag} '{str(path)[:60]}...' has a folder name {len(long[0].encode())} bytes long; a folder "
            f"name holds at most 255."
        )


def import_user_modules(names: list[str]) -> None:
    """``--import``: each module by name (the current folder on the path), or a ``.py`` file by its
    stem from its folder (so that sweep workers import it by name too); one sentence when it fails."""
    from fedskew.algorithms import import_module_of
    from fedskew.config import ConfigError

    for given in names:
        name = Path(given).stem if given.endswith(".py") else given
        if given.endswith(".py") and not Path(given).is_file():
            raise ConfigError(f"--import '{given}': no such file.")
        try:
            import_module_of(given)
        except SystemExit as exc:  # a module that ends the process at import would end a bench with its code
            raise ConfigError(f"--import '{name}' called sys.exit({exc.code!r}) while being imported; a module "
                              f"that registers methods must not exit.") from None
        except Exception as exc:
            if _SIGNALLED is not None:  # a Ctrl-C that the module's import turned into another exception
                raise KeyboardInterrupt from None
            why = (str(exc).splitlines() or [""])[0][:200] or "(no message)"
            raise ConfigError(f"--import '{name}' failed: {type(exc).__name__}: {why}.") from None


def entry() -> None:
    """The ``fedskew`` command and ``python -m fedskew.cli``: :func:`main`, then the exit. After an
    interrupted sweep the process ends at once (streams flushed, ``os._exit``): nothing is left to
    write, and interpreter shutdown could otherwise wait on the process pool's threads or a dying
    worker (a group-wide Ctrl-C hung there in about 1 of 10 tries on 2 busy cores)."""
    code = main()
    if _END_NOW:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
