"""Continuing a run from its directory (``fedskew resume DIR [key=value ...]``)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from fedskew.config import ConfigError, did_you_mean, parse_override, read_config_file, set_key, validate_config
from fedskew.engine.rundir import RESUMABLE, RunResult
from fedskew.engine.runner import Experiment


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
    if not written_by_fedskew(run_dir / "config.yaml"):
        # only what fedskew wrote resumes: a config.yaml of the user's is not a run, and training in
        # its folder would overwrite the files beside it
        raise ConfigError(f"'{run_dir}' holds a config.yaml that no fedskew run wrote (it has no fedskew_version and "
                          f"environment record), so it is not resumed; `fedskew run {run_dir / 'config.yaml'} "
                          f"out_dir=DIR` starts a run from it elsewhere.")
    from fedskew.engine.rundir import RunDir, run_identity

    files = RunDir(run_dir)
    if os.path.lexists(run_dir / "run.json") and not (run_dir / "run.json").is_file():
        raise ConfigError(f"'{run_dir / 'run.json'}' is not a file (a folder or a link stands where the run's record "
                          f"goes), so '{run_dir}' is not resumed and nothing in it is touched.")
    not_a_run = (f"'{run_dir}' holds a config.yaml but nothing shows that a fedskew run wrote this folder (no "
                 f"checkpoint of that config and its run.json), so it is not resumed and nothing in it is touched; "
                 f"`fedskew run {run_dir / 'config.yaml'} out_dir=DIR` starts the run elsewhere.")
    # the folder is proven to be the run's before anything it names is imported: a run of the user's
    # method is checked with a stand-in for the method (its options as config.yaml records them)
    with stand_in(data):
        identity = run_identity(validate_config(data))
        proven, unreadable = files.proves(identity), files.unreadable(identity)
    if not proven and unreadable:  # the run's own folder whose checkpoints are damaged: nothing to resume from
        raise ConfigError(f"no readable checkpoint in '{run_dir}' ({'; '.join(unreadable)}); remove the directory "
                          f"(or choose another run_name) and start the run again.")
    if not proven:
        # a config.yaml copied from a real run does not make a folder a run: training here would
        # replace what the folder holds
        raise ConfigError(not_a_run)
    import_recorded_method(run_dir, data)
    if not files.proves(run_identity(validate_config(data))):
        raise ConfigError(not_a_run)
    if isinstance(changes, list):
        changes = {".".join(k): v for k, v in map(parse_override, changes)}
    changes = dict(changes or {})
    for key in changes:
        if key not in RESUMABLE:
            raise ConfigError(f"'{key}' cannot change when a run resumes (the rounds before and after would be "
                              f"different experiments){did_you_mean(key, RESUMABLE)}; these can: "
                              f"{', '.join(RESUMABLE)}.")
    done = finished_rounds(run_dir, data)
    if done is not None and not changes:  # read back as it is: nothing runs, nothing is written
        exp = Experiment(validate_config(data), run_dir, resume=True)
        result = exp.finished_result()
        if result is not None:
            print(f"fedskew: run '{run_dir}' finished its {done} rounds: nothing runs, its results are read back "
                  f"(`fedskew resume {run_dir} rounds=N` with N > {done} extends it).", file=sys.stderr)
            return result
        # its last checkpoint was unreadable: the last rounds again, exactly, from the one before
        print(f"fedskew: run '{run_dir}' finished its {done} rounds but its last checkpoint cannot be read: the rounds "
              f"after the one before run again (the same results).", file=sys.stderr)
        return exp.run(on_round)
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


def _method_name(data: dict) -> str | None:
    method = data.get("method")
    name = method.get("name") if isinstance(method, dict) else method
    return name if isinstance(name, str) else None


@contextlib.contextmanager
def stand_in(data: dict):
    """While the config's method is not registered: a stand-in under its name that takes the options
    config.yaml records as they are (a run writes every option resolved), so that the run's identity
    can be checked before its method's module is imported."""
    from pydantic import ConfigDict

    from fedskew.algorithms import METHODS, Method
    from fedskew.algorithms.base import FedAvgOptions

    name = _method_name(data)
    if name is None or name in METHODS:
        yield
        return

    class AnyOptions(FedAvgOptions):
        model_config = ConfigDict(extra="allow")

    METHODS[name] = type("StandIn", (Method,), {"Options": AnyOptions, "name": name, "source": None})
    try:
        yield
    finally:
        METHODS.pop(name, None)


def import_recorded_method(run_dir: Path, data: dict) -> None:
    """A run of the user's method that this process has not registered is never resumed by importing
    what its folder names: code runs only from ``--import`` (or ``fedskew.register_method`` in the
    user's own process). run.json's ``method_source`` only says what to pass: one sentence naming the
    file the run was started with."""
    from fedskew.algorithms import registered
    from fedskew.engine.rundir import RunDir

    name = _method_name(data)
    if name is None or name in registered():
        return
    source = RunDir(run_dir).record().get("method_source")
    file = source.get("file") if isinstance(source, dict) else None
    hint = (f"`fedskew resume --import {str(file)[:200]} {run_dir}` continues it if that file (the one the run was "
            f"started with) is yours, or pass --import MODULE naming the module that defines '{name}'"
            if isinstance(file, str) else f"pass --import MODULE naming the module that defines '{name}'")
    raise ConfigError(f"run '{run_dir}' trains method '{name}', which this process has not registered, and a run "
                      f"folder never imports code by itself: {hint}.")


def written_by_fedskew(path: Path) -> bool:
    """Whether a run's ``config.yaml`` is fedskew's record (its version and the environment beside the
    config), not a file of the user's."""
    from fedskew.files import FileProblem, read_yaml

    try:
        record = read_yaml(path, "run config record", own=True)
    except FileProblem:
        return False
    return isinstance(record, dict) and "fedskew_version" in record and isinstance(record.get("environment"), dict)


def finished_rounds(run_dir: Path, data: dict) -> int | None:
    """The rounds of a finished run (``summary.json`` written for the rounds config.yaml asks for),
    else None: not started, interrupted, or an extension of it interrupted."""
    from fedskew.files import FileProblem, read_json

    try:
        summary = read_json(run_dir / "summary.json", "run summary", own=True)
    except FileProblem:
        return None
    rounds = summary.get("rounds") if isinstance(summary, dict) else None
    return rounds if isinstance(rounds, int) and rounds == data.get("rounds", rounds) else None


__all__ = ["RESUMABLE", "finished_rounds", "resume"]
