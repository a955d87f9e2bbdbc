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
import sys
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

        mode = os.environ.get("WANDB_MODE", "offline")
        if mode not in WANDB_MODES:
            raise ConfigError(f"WANDB_MODE is '{mode[:40]}'; W&B takes {', '.join(WANDB_MODES)}")
        run_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]  # the same id when resumed
        self.run = wandb.init(mode=mode, dir=str(run_dir),
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
        scheme = uri.split(":", 1)[0].lower() if ":" in uri else "file"
        if scheme not in MLFLOW_SCHEMES:
            raise ConfigError(f"MLFLOW_TRACKING_URI '{uri[:80]}' has the scheme '{scheme[:20]}'; MLflow tracks to "
                              f"{', '.join(MLFLOW_SCHEMES)}")
        store = run_dir.parent / "mlflow.db"
        if "MLFLOW_TRACKING_URI" not in os.environ and os.path.lexists(store) and not store.is_file():
            raise ConfigError(f"'{store}' is not a file (MLflow's store goes there)")
        for key, value in MLFLOW_BOUNDS.items():  # an unreachable server: seconds of retries, not minutes
            os.environ.setdefault(key, value)
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        name = group or "fedskew"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        tag = str(run_dir.resolve())
        key = hashlib.sha1(tag.encode()).hexdigest()[:16]  # a filter-safe name of the folder (a path may hold quotes)
        found = self.client.search_runs([experiment_id], filter_string=f"tags.run_key = '{key}'")
        if not found and "'" not in tag and "\\" not in tag:  # a run begun by fedskew before run_key
            found = self.client.search_runs([experiment_id], filter_string=f"tags.run_dir = '{tag}'")
        self.seen = -1  # the last step the run holds: a resumed run's replay of it is skipped (no duplicates)
        if found:  # resumed: the same MLflow run
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            self.seen = max((m.step for m in self.client.get_metric_history(self.run_id, "lr")), default=-1)
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name,
                                                 tags={"run_dir": tag, "run_key": key}).info.run_id
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
WANDB_MODES = ("offline", "online", "disabled", "shared", "dryrun", "run")
MLFLOW_SCHEMES = ("file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks")
# MLflow's HTTP client retries an unreachable server with exponential backoff for minutes by default
# (7 retries, factor 2, 120 s timeout); a user's own setting of these variables is kept
MLFLOW_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


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
        self.adapters: dict[str, object] = {}
        for name in cfg.logger:
            try:
                self.adapters[name] = ADAPTERS[name](cfg, run_dir, cfg.logger_group, start)
            except Exception as exc:  # a tracker that cannot start: one sentence before any round trains
                self.finish(None)
                why = (str(exc).splitlines() or [""])[0][:200] or type(exc).__name__
                others = [n for n in cfg.logger if n != name]
                raise ConfigError(f"tracker '{name}' (config key 'logger') cannot start: {why}; no round was trained "
                                  f"and the run's folder is kept: `fedskew resume {run_dir}` continues it once the "
                                  f"tracker is fixed, `fedskew resume {run_dir} logger=[{','.join(others)}]` without "
                                  f"it.") from None

    def log(self, record: dict) -> None:
        values = scalars(record)
        for name, a in list(self.adapters.items()):
            self._guarded(name, lambda a=a: a.log(record["round"], values))

    def finish(self, summary: dict | None) -> None:
        for name, a in list(self.adapters.items()):
            self._guarded(name, lambda a=a: a.finish(summary))

    def _guarded(self, name: str, call) -> None:
        """A tracker that fails mid-run is dropped with one warning: the run's own files (metrics.jsonl,
        checkpoints, summary.json) hold every round whatever the tracker does."""
        try:
            call()
        except Exception as exc:
            self.adapters.pop(name, None)
            why = (str(exc).splitlines() or [""])[0][:200] or type(exc).__name__
            print(f"fedskew: warning: tracker '{name}' failed ({why}) and is dropped for the rest of this run; the "
                  f"run goes on, and its own files keep every round.", file=sys.stderr, flush=True)


__all__ = ["ADAPTERS", "Trackers", "check_available", "scalars"]
