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
    the next round on, recorded in config.yaml's ``changes``. A finished run is read-only: with no
    changes it is read back (nothing runs or is written), ``rounds`` > its rounds extends it, any
    other change is refused."""
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
    done = finished_rounds(run_dir, data)
    if done is not None and not changes:  # read back as it is: nothing runs, nothing is written
        exp = Experiment(validate_config(data), run_dir, resume=True)
        result = exp.finished_result()
        if result is not None:
            return result
        return exp.run(on_round)  # its last checkpoint was unreadable: the last rounds again, exactly
    if done is not None:  # a finished run is read-only; only more rounds extend it
        try:
            extends = int(str(changes.get("rounds"))) > done
        except ValueError:
            extends = False
        if not extends:
            what = " ".join(f"{k}={v}" for k, v in changes.items())
            raise ConfigError(f"run '{run_dir}' finished its {done} rounds and is read-only, so it is not resumed "
                              f"with {what}; `fedskew resume {run_dir} rounds=N` with N > {done} extends it (other "
                              f"changes may come with it), or start a new run.")
    for key, value in changes.items():
        set_key(data, key, value)
    exp = Experiment(validate_config(data), run_dir, resume=True)
    exp.changes = changes
    return exp.run(on_round)


def finished_rounds(run_dir: Path, data: dict) -> int | None:
    """The rounds of a finished run (``summary.json`` written for the rounds config.yaml asks for),
    else None: not started, interrupted, or an extension of it interrupted."""
    import json

    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    rounds = summary.get("rounds") if isinstance(summary, dict) else None
    return rounds if isinstance(rounds, int) and rounds == data.get("rounds", rounds) else None


__all__ = ["RESUMABLE", "finished_rounds", "resume"]
