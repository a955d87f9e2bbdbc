"""Continuing a run from its directory (``fedskew resume DIR [key=value ...]``)."""

from __future__ import annotations

from pathlib import Path

from fedskew.config import ConfigError, did_you_mean, parse_override, read_config_file, set_key, validate_config
from fedskew.engine.rundir import RunResult
from fedskew.engine.runner import Experiment

# Settings a run may change when resumed (`fedskew resume DIR lr=0.005`): how it is optimised from now
# on, evaluated and recorded; not what it is (data, partition, model, method, seed).
RESUMABLE = ("lr", "lr_decay", "grad_clip", "rounds", "eval_every", "checkpoint_every", "fail_fast", "logger",
             "final_personalization", "device", "executor", "distributed", "max_parallel_clients", "pad_batches",
             "precision", "feature_stats", "classifier_stats", "forgetting_stats", "forgetting_test_samples")


def resume(run_dir: str | Path, on_round=None, changes: dict | list[str] | None = None) -> RunResult:
    """Continue an interrupted run from its directory's ``checkpoint.pt`` and ``config.yaml``;
    ``changes`` (``{"lr": 0.005}`` or ``["lr=0.005"]``) alters settings of :data:`RESUMABLE` from
    the next round on, recorded in config.yaml's ``changes``."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"'{run_dir}' is not a run directory (it holds no config.yaml).")
    data = read_config_file(run_dir / "config.yaml")
    if isinstance(changes, list):
        changes = {".".join(k): v for k, v in map(parse_override, changes)}
    changes = dict(changes or {})
    for key, value in changes.items():
        if key not in RESUMABLE:
            raise ConfigError(f"'{key}' cannot change when a run resumes (the rounds before and after would be "
                              f"different experiments){did_you_mean(key, RESUMABLE)}; these can: "
                              f"{', '.join(RESUMABLE)}.")
        set_key(data, key, value)
    exp = Experiment(validate_config(data), run_dir, resume=True)
    exp.changes = changes
    return exp.run(on_round)


__all__ = ["RESUMABLE", "resume"]
