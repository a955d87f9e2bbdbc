"""Command line: ``fedskew run``, ``fedskew resume`` and ``fedskew partition``.

``fedskew run [CONFIG.yaml] [key=value ...]`` runs one experiment (with no arguments, FedAvg on
the bundled digits data under a PxCy partition) and prints a results table.
"""

from __future__ import annotations

import argparse
import sys
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
    from fedskew.config import ConfigError
    from fedskew.data import DatasetError, PartitionError
    from fedskew.engine.runner import ClientFailure
    from fedskew.models import ModelError

    commands = {"run": cmd_run, "resume": cmd_resume, "partition": cmd_partition}
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
