"""Command line: ``fedskew run``, ``fedskew resume`` and ``fedskew partition``.

``fedskew run [CONFIG.yaml] [key=value ...]`` runs one experiment (with no arguments, FedAvg on
the bundled digits data under a PxCy partition) and prints a results table.
"""

from __future__ import annotations

import argparse
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
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("[bold]round"), MofNCompleteColumn(), BarColumn(),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console)
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


def _results_table(summary: dict, run_dir: Path) -> Table:
    table = Table(title=f"fedskew {summary['method']} on {summary['dataset']} / {summary['partition']} "
                        f"(seed {summary['seed']}, {summary['rounds']} rounds)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    keys = ["global/test_acc", "global/test_acc_best", "global/test_acc_mean_last10",
            "personal/acc_before", "personal/acc_after", "personal/final_acc_before",
            "personal/final_acc_after", "comm/down_floats_total", "comm/up_floats_total", "comm/extra_pct",
            "time/round_s_mean"]
    for k in keys:
        if k in summary:
            table.add_row(k, _fmt(summary[k]))
    table.caption = f"run directory: {run_dir}"
    return table


def cmd_run(args, console: Console) -> int:
    from fedskew.config import ConfigError, load_config
    from fedskew.engine.runner import Experiment

    if args.resume:
        if args.items:
            raise ConfigError(f"fedskew run --resume takes no config or overrides (got {' '.join(args.items)}); "
                              f"the run directory's config.yaml is used.")
        args.run_dir = args.resume
        return cmd_resume(args, console)
    config, overrides = _split_args(args.items)
    cfg = load_config(config, overrides)
    exp = Experiment(cfg)
    console.print(f"fedskew {__version__}: {cfg.method.name} on {exp.fed.data.describe()}; "
                  f"{cfg.partition.name} partition of {exp.fed.num_clients} clients; model {cfg.model.name}; "
                  f"executor {cfg.executor}; run directory {exp.run_dir}", highlight=False)
    return _execute(exp.run, cfg.rounds, console)


def cmd_resume(args, console: Console) -> int:
    from fedskew.engine.runner import resume
    from fedskew.config import load_config

    cfg = load_config(Path(args.run_dir) / "config.yaml") if (Path(args.run_dir) / "config.yaml").is_file() else None
    rounds = cfg.rounds if cfg else 0
    return _execute(lambda on_round: resume(args.run_dir, on_round), rounds, console)


def _execute(fn, rounds: int, console: Console) -> int:
    progress, on_round = _progress(console, rounds)
    if progress is not None:
        with progress:
            result = fn(on_round)
    else:
        result = fn(on_round)
    console.print(_results_table(result.summary, result.run_dir))
    return 0


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
    out = Path(args.out)
    fed.heatmap(out)
    console.print(f"heatmap written to {out}")
    return 0


def _run_and_report(spec, out: str | None, jobs: int | None, report: bool, console: Console) -> int:
    from fedskew.experiments.report import write_report
    from fedskew.experiments.sweep import default_jobs, default_sweep_dir, run_sweep

    sweep_dir = Path(out) if out else default_sweep_dir(spec)
    runs = len(spec.methods) * len(spec.partitions) * len(spec.seeds)
    jobs = jobs or default_jobs()
    console.print(f"fedskew sweep '{spec.name}': {len(spec.methods)} methods x {len(spec.partitions)} partitions x "
                  f"{len(spec.seeds)} seeds (+ grids) into {sweep_dir}, {jobs} at a time", highlight=False)
    t0 = time.perf_counter()

    def on_event(kind, r):
        if kind == "skipped":
            console.print(f"  {r['label']} {r['partition']} seed {r['seed']}: already done", highlight=False)
        elif kind == "done":
            acc = r["summary"].get("global/test_acc_mean_last10")
            pers = r["summary"].get("personal/final_acc_after")
            console.print(f"  {r['label']} {r['params'] or ''} {r['partition']} seed {r['seed']}: "
                          f"global/test_acc_mean_last10 {_fmt(acc)}  personal/final_acc_after {_fmt(pers)}  "
                          f"({time.perf_counter() - t0:.0f}s)", highlight=False)
        elif kind == "failed":
            console.print(f"  {r['label']} {r['partition']} seed {r['seed']}: FAILED: {r['error']}", highlight=False)

    db = run_sweep(spec, sweep_dir, jobs, on_event)
    failed = db.execute("SELECT COUNT(*) FROM runs WHERE status='failed'").fetchone()[0]
    db.close()
    console.print(f"{runs} runs planned, {failed} failed; results in {sweep_dir / 'results.sqlite'} "
                  f"({time.perf_counter() - t0:.0f}s)", highlight=False)
    if report:
        md, page = write_report(sweep_dir)
        console.print(md.read_text().split("\n## ", 2)[1].split("\n", 1)[1].strip(), highlight=False)
        console.print(f"report: {md} and {page}", highlight=False)
    return 1 if failed else 0


def cmd_sweep(args, console: Console) -> int:
    from fedskew.experiments.presets import default_comparison
    from fedskew.experiments.sweep import load_spec

    spec = load_spec(args.file if args.file else default_comparison())
    return _run_and_report(spec, args.out, args.jobs, not args.no_report, console)


def cmd_reproduce(args, console: Console) -> int:
    from fedskew.experiments.presets import reproduction
    from fedskew.experiments.sweep import load_spec

    spec = load_spec(reproduction(args.name, args.scale, args.data))
    out = args.out or str(Path("runs") / f"reproduce-{args.name}-{args.scale}")
    return _run_and_report(spec, out, args.jobs, True, console)


def cmd_report(args, console: Console) -> int:
    from fedskew.experiments.report import write_report

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
    from fedskew.engine.runner import default_run_dir

    fl = _flower()
    config, overrides = _split_args(args.items)
    cfg = load_config(config, overrides)
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
    env = fl.flower_env(FLWR_HOME=str(home.resolve()))
    console.print(f"fedskew {__version__}: {cfg.method.name} on Flower at {args.superlink}, "
                  f"{cfg.partition.num_clients} SuperNodes expected; run directory {run_dir.resolve()}", highlight=False)
    done = subprocess.run(["flwr", "run", str(app_dir), "fedskew", "--stream"], env=env)  # flwr found via env PATH
    summary_path = run_dir / "summary.json"
    if done.returncode != 0 or not summary_path.is_file():
        console.print(f"the Flower run did not finish (flwr exit code {done.returncode}); the ServerApp's log is "
                      f"above; no {summary_path} was written here (it is written on the SuperLink's machine).",
                      highlight=False)
        return 1
    import json

    console.print(_results_table(json.loads(summary_path.read_text()), run_dir))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedskew", description="Federated learning under label skew.",
                                     epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"fedskew {__version__}")
    sub = parser.add_subparsers(dest="command")
    p_run = sub.add_parser("run", help="run one experiment", epilog=EPILOG)
    p_run.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value]")
    p_run.add_argument("--resume", metavar="RUN_DIR", help="continue the interrupted run in RUN_DIR")
    p_res = sub.add_parser("resume", help="continue an interrupted run from its directory")
    p_res.add_argument("run_dir")
    p_part = sub.add_parser("partition", help="print and draw a partition", epilog=EPILOG)
    p_part.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value]")
    p_part.add_argument("--out", default="partition.png", help="heatmap PNG path (default partition.png)")
    p_sw = sub.add_parser("sweep", help="methods x options x partitions x seeds into a results database and a "
                                         "report (no file: FedAvg vs the four seed methods on digits)")
    p_sw.add_argument("file", nargs="?", help="sweep YAML (see fedskew/experiments/sweep.py)")
    p_sw.add_argument("--out", help="sweep folder (default runs/sweep-<name>); running again resumes it")
    p_sw.add_argument("--jobs", type=int, help="runs at once, one torch thread each (default: min(2, cores))")
    p_sw.add_argument("--no-report", action="store_true", help="skip the report at the end")
    p_rep = sub.add_parser("report", help="tables and plots of a sweep folder as Markdown and HTML")
    p_rep.add_argument("sweep_dir")
    p_rep.add_argument("--out", help="report folder (default SWEEP_DIR/report)")
    p_rep.add_argument("--metric", help="main metric (default global/test_acc_mean_last10)")
    p_rep.add_argument("--baseline", help="the method gains are measured against (default fedavg)")
    p_pro = sub.add_parser("reproduce", help="a seed paper's main table at smoke, small or paper scale")
    p_pro.add_argument("name", help="fedmr, map, etf or fedka")
    p_pro.add_argument("--scale", default="smoke", help="smoke (digits, CI), small (Fashion-MNIST, < 1 h on a CPU) "
                                                       "or paper")
    p_pro.add_argument("--data", help="folder holding the data set (small and paper scales)")
    p_pro.add_argument("--out", help="sweep folder (default runs/reproduce-<name>-<scale>)")
    p_pro.add_argument("--jobs", type=int)
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
    from fedskew.config import ConfigError
    from fedskew.data import DatasetError, PartitionError
    from fedskew.engine.runner import ClientFailure
    from fedskew.models import ModelError

    commands = {"run": cmd_run, "resume": cmd_resume, "partition": cmd_partition, "sweep": cmd_sweep,
                "report": cmd_report, "reproduce": cmd_reproduce, "flower": cmd_flower}
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return commands[args.command](args, console)
    except (ConfigError, DatasetError, PartitionError, ModelError, FloatingPointError, ClientFailure) as exc:
        print(f"fedskew: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
