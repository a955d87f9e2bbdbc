"""Experiment tracking: a run's per-round records, also in TensorBoard, Weights & Biases or MLflow.

``logger=[tensorboard, wandb, mlflow]`` (any of them, each an optional extra) adds one adapter per
tool over the same records ``metrics.jsonl`` holds: every numeric value of a round under its
metric name (``global/test_acc``, ``train/loss``, ...) at step = round, the resolved config as
parameters, the summary at the end. Runs of a sweep are grouped by the sweep's name
(``logger_group``). Where each tool writes:

- ``tensorboard``: ``RUN_DIR/tensorboard`` (event files; ``tensorboard --logdir runs``);
- ``wandb``: ``RUN_DIR/wandb``, offline unless ``WANDB_MODE=online`` (``wandb sync`` uploads
  later); project ``$WANDB_PROJECT`` or ``fedskew``;
- ``mlflow``: ``$MLFLOW_TRACKING_URI``, else a SQLite store ``mlflow.db`` beside the run directory
  (``mlflow ui --backend-store-uri sqlite:///runs/mlflow.db``); experiment = the group or ``fedskew``.

A round goes to the trackers before its checkpoint, and a resumed run continues the same tracked run (TensorBoard drops
the steps after the checkpoint, W&B resumes its run id and, online, ignores the steps it holds, MLflow resumes its run
and skips them), so a crash at any point leaves no round missing and no duplicate point.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from fedskew.config import ConfigError, RunConfig

EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def scalars(record: dict) -> dict[str, float]:
    """The finite numbers of a record (no lists, no None, no flags)."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "round"}


def flat_params(data: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(flat_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, type(None))) else str(v)
    return out


class TensorBoard:
    def __init__(self, cfg: RunConfig, run_dir: Path, group: str | None, start: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run overwrites what the crashed one logged after its checkpoint
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start or None)
        if not start:
            self.writer.add_text("config", "```\n" + json.dumps(cfg.resolved(), indent=2) + "\n```", 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def finish(self, summary: dict | None) -> None:
        self.writer.close()


class WandB:
    def __init__(self, cfg: RunConfig, run_dir: Path, group: str | None, start: int):
        import wandb

        run_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]  # the same id when resumed
        self.run = wandb.init(mode=os.environ.get("WANDB_MODE", "offline"), dir=str(run_dir),
                              project=os.environ.get("WANDB_PROJECT", "fedskew"), group=group, name=run_dir.name,
                              id=run_id, resume="allow", config=cfg.resolved(), reinit="create_new",
                              settings=wandb.Settings(quiet=True))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def finish(self, summary: dict | None) -> None:
        if summary:
            self.run.summary.update(scalars(summary))
        self.run.finish(exit_code=0 if summary is not None else 1)


class MLflow:
    def __init__(self, cfg: RunConfig, run_dir: Path, group: str | None, start: int):
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run_dir.parent / 'mlflow.db').resolve()}"
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        name = group or "fedskew"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        tag = str(run_dir.resolve())
        found = self.client.search_runs([experiment_id], filter_string=f"tags.run_dir = '{tag}'")
        self.seen = -1  # the last step the run holds: a resumed run's replay of it is skipped (no duplicates)
        if found:  # resumed: the same MLflow run
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            self.seen = max((m.step for m in self.client.get_metric_history(self.run_id, "lr")), default=-1)
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name,
                                                 tags={"run_dir": tag}).info.run_id
            for k, v in flat_params(cfg.resolved()).items():
                self.client.log_param(self.run_id, k, v[:6000])

    def log(self, step: int, values: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        if step <= self.seen:
            return
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def finish(self, summary: dict | None) -> None:
        if summary:
            self.log(summary.get("rounds", 0), {f"summary/{k}": v for k, v in scalars(summary).items()})
        self.client.set_terminated(self.run_id, status="FINISHED" if summary is not None else "FAILED")


ADAPTERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def check_available(names: list[str]) -> None:
    """One sentence per missing package, before anything runs."""
    import importlib.util

    for name in names:
        if importlib.util.find_spec(EXTRAS[name]) is None:
            raise ConfigError(f"config key 'logger' = '{name}' needs the {EXTRAS[name]} package: "
                              f"pip install 'fedskew[{name}]'.")


class Trackers:
    """The adapters a config asks for, driven by the round loop."""

    def __init__(self, cfg: RunConfig, run_dir: Path, start: int):
        self.adapters = [ADAPTERS[name](cfg, run_dir, cfg.logger_group, start) for name in cfg.logger]

    def log(self, record: dict) -> None:
        values = scalars(record)
        for a in self.adapters:
            a.log(record["round"], values)

    def finish(self, summary: dict | None) -> None:
        for a in self.adapters:
            a.finish(summary)


__all__ = ["ADAPTERS", "Trackers", "check_available", "scalars"]
