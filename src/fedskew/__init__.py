"""fedskew: federated learning under label skew, from Python.

One run::

    import fedskew

    result = fedskew.run(method="fedmr", rounds=30)                  # keyword = a config key
    result = fedskew.run("examples/fedavg_digits.yaml", **{"partition.classes_per_client": 2})
    result = fedskew.run({"method": "map", "partition": "random_classes"}, overrides={"rounds": 10})
    result.summary["global/test_acc"]        # what summary.json holds
    result.curve("global/test_acc")          # [(round, value), ...] from result.history
    result.model                             # the final global model (an nn.Module, eval mode)
    fedskew.resume(result.run_dir)           # continue an interrupted run exactly

A config is ``None`` (the defaults: FedAvg on digits, P20C3), a mapping (nested or dotted keys),
a YAML file or a :class:`RunConfig`; keyword arguments and ``overrides`` set keys on top of it,
dotted for nested keys (``**{"method.mu1": 0.01}``), with Python values. ``fedskew.run(config, **overrides)`` does
exactly what ``fedskew run CONFIG key=value ...`` does (tested). Bad input raises
:class:`ConfigError` with one sentence naming the key, the value and what is allowed.

Many runs::

    sweep_dir = fedskew.sweep("examples/sweep_fmnist.yaml", jobs=2)  # methods x grids x partitions x seeds
    fedskew.report(sweep_dir)                                        # report.md + report.html
    table = fedskew.load_results(sweep_dir)    # pandas DataFrame when pandas is installed, else a list of dicts

Your own method: subclass :class:`Method` (docs/design.md, "A method is a few pure functions"),
register it, and name it in any config; it runs on both executors, in sweeps and in reports::

    @fedskew.register_method
    class LogitNorm(fedskew.Method):
        name = "logitnorm"
        def local_loss(self, fwd, params, x, y, payload, client_state): ...

    fedskew.run(method="logitnorm")
    fedskew.methods()                          # {"fedavg": Method, "fedmr": FedMR, ...}

``examples/custom_method.py`` defines that one in 20 lines and compares it with FedAvg. A sweep with
``jobs > 1`` imports the method's module in each worker, so a script that registers one runs its
sweep under ``if __name__ == "__main__":``. The Flower runtime does not see registered methods yet.

Names (looked up on first use, so ``import fedskew`` stays light): :class:`Method`,
:class:`FederationInfo`, :class:`Forward`, :class:`ClientReport` (the method interface,
``fedskew.algorithms.base``), :class:`RunConfig`, :class:`ConfigError` (``fedskew.config``),
:class:`RunResult` (``fedskew.engine.runner``).

Layout: ``fedskew.config`` (run schema), ``fedskew.data`` / ``fedskew.models`` (data sets,
partitions, networks), ``fedskew.algorithms`` (one module per method family), ``fedskew.metrics``,
``fedskew.engine`` (executors and the round loop), ``fedskew.experiments`` (sweeps, results store,
reports, presets), ``fedskew.flower`` (Flower apps), ``fedskew.streams`` (named random streams),
``fedskew.cli`` (the ``fedskew`` command).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from fedskew.algorithms.base import Method
    from fedskew.config import RunConfig
    from fedskew.engine.rundir import RunResult

_LAZY = {"Method": "fedskew.algorithms.base", "FederationInfo": "fedskew.algorithms.base",
         "Forward": "fedskew.algorithms.base", "ClientReport": "fedskew.algorithms.base",
         "RunConfig": "fedskew.config", "ConfigError": "fedskew.config", "RunResult": "fedskew.engine.runner"}


def __getattr__(name: str):
    """The classes of the API, imported on first use (``fedskew.Method``, ``fedskew.RunResult``, ...)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fedskew' has no attribute '{name}'")


def load_config(config: Mapping | str | Path | RunConfig | None = None, /,
                overrides: Mapping[str, Any] | list[str] | None = None, **options: Any) -> RunConfig:
    """The validated :class:`RunConfig` that :func:`run` would run (same arguments, nothing runs).

    ``overrides`` is a mapping of (dotted) keys to values, or a list of ``key=value`` strings
    parsed as on the command line; keyword ``options`` come first, ``overrides`` after."""
    from fedskew.config import (
        RECORD_KEYS,
        ConfigError,
        RunConfig,
        apply_overrides,
        nested,
        read_config_file,
        set_key,
        validate_config,
    )

    if config is None:
        data: dict = {}
    elif isinstance(config, RunConfig):
        data = config.model_dump(mode="json")
    elif isinstance(config, Mapping):
        data = nested(dict(config))  # dotted keys allowed, as in a sweep's base
        for key in RECORD_KEYS:
            data.pop(key, None)
    elif isinstance(config, (str, Path)):
        data = read_config_file(config)
    else:
        raise ConfigError(f"config must be a mapping, a YAML path or a RunConfig, not a {type(config).__name__}.")
    for key, value in options.items():
        set_key(data, key, value)
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            set_key(data, key, value)
    elif overrides is not None:
        apply_overrides(data, list(overrides))
    return validate_config(data)


def run(config: Mapping | str | Path | RunConfig | None = None, /,
        overrides: Mapping[str, Any] | list[str] | None = None, *,
        on_round: Callable[[dict], None] | None = None, progress: bool | None = None, **options: Any) -> RunResult:
    """Run one federated experiment and return its :class:`RunResult` (summary, per-round history,
    final global state and model, run directory).

    ``config``: None (the defaults), a mapping, a YAML file or a :class:`RunConfig`; keyword
    ``options`` and ``overrides`` set keys on top (see :func:`load_config`). ``on_round`` is called with
    each round's record. ``progress``: print a line per round (round, loss, global accuracy, seconds);
    None (the default) prints them when standard output is a terminal, as ``fedskew run`` does. The
    run directory is ``out_dir/run_name`` (default ``runs/<method>-<dataset>-<partition>-s<seed>-<time>``),
    as with ``fedskew run``."""
    import sys

    from fedskew.engine.runner import Experiment

    cfg = load_config(config, overrides, **options)
    if progress or (progress is None and sys.stdout.isatty()):
        callback = on_round

        def on_round(rec: dict) -> None:
            acc = rec.get("global/test_acc")
            print(f"round {rec['round'] + 1}/{cfg.rounds}  train/loss {rec['train/loss']:.4f}" +
                  (f"  global/test_acc {acc:.4f}" if acc is not None else "") +
                  f"  time/round_s {rec['time/round_s']:.2f}", flush=True)
            if callback is not None:
                callback(rec)
    return Experiment(cfg).run(on_round)


def resume(run_dir: str | Path, *, on_round: Callable[[dict], None] | None = None, **changes: Any) -> RunResult:
    """Continue the interrupted run in ``run_dir`` from its last checkpoint (exactly: the result
    equals an uninterrupted run's). ``changes`` (``lr=0.005``, ``rounds=100``, ``grad_clip=1.0``,
    ...) alter how it continues from the next round on, recorded in its config.yaml
    (``fedskew.engine.resume.RESUMABLE`` lists them). A finished run is read-only: with no changes
    it is read back as it is, ``rounds`` above its rounds extends it, other changes are refused."""
    from fedskew.engine.resume import resume as resume_run

    return resume_run(run_dir, on_round, changes)


def sweep(spec: Mapping | str | Path | Any | None = None, /, jobs: int | None = None, out: str | Path | None = None, *,
          on_event: Callable[[str, dict], None] | None = None, ray: str | None = None,
          on_progress: Callable[[dict], None] | None = None, progress: bool | None = None,
          pack: str | int = "auto") -> Path:
    """Run a sweep (methods x option grids x partitions x seeds) into a folder with a SQLite results
    store and one run directory per run; returns the folder (default ``runs/sweep-<name>``).

    ``spec``: a mapping, a YAML file in the format of :mod:`fedskew.experiments.sweep` or a ``SweepSpec``; None is
    ``fedskew sweep``'s default comparison. ``jobs`` runs at once (default min(2, cores)), one torch thread each.
    Running it again skips finished runs and resumes interrupted ones. ``on_event`` is called with ``("skipped" |
    "started" | "round" | "done" | "failed", run)`` (``"round"``: after each round of a run in this process or a worker,
    with ``run["round"]`` rounds done of ``run["rounds"]``; Ray reports none). ``on_progress`` is called after every
    event with the sweep's progress: ``runs_done``, ``runs_running``, ``runs_failed``, ``runs_total``, ``rounds_done``,
    ``rounds_total``, ``elapsed_s`` and ``eta_s`` (from the measured round rate; None until a round is done);
    ``progress`` prints it as a line to stderr every 30 s and after each run: by default where a person watches (stderr
    is a terminal, or a Jupyter kernel runs the code), ``False`` never, ``True`` always. ``ray``: run on Ray instead
    (``"local"`` starts an instance; ``"auto"``, ``"host:port"``, ``"ray://host:10001"`` join a cluster; per-run
    resources from the spec's ``resources``; docs/scaling.md). ``pack``: runs on the vectorised executor that differ
    only in seed, partition, lr or float method options train as lanes of one program (``"auto"``: on a CUDA device;
    ``"off"``; or N runs a pack; docs/design.md, "Runs as lanes"). Failed runs are listed by
    :func:`load_results` (``status``, ``error``) and announced with a warning."""
    import sys
    import warnings

    from fedskew.experiments.pool import script_methods, unguarded_script_line
    from fedskew.experiments.presets import default_comparison
    from fedskew.experiments.spec import (
        SweepSpec,
        default_jobs,
        default_sweep_dir,
        load_spec,
        planned_count,
        rounds_per_run,
    )
    from fedskew.experiments.sweep import SweepProgress, progress_line, run_sweep

    parsed = spec if isinstance(spec, SweepSpec) else \
        load_spec(dict(spec) if isinstance(spec, Mapping) else spec if spec is not None else default_comparison())
    if progress is None:  # a person is watching: a terminal, or a notebook's kernel
        progress = sys.stderr.isatty() or "ipykernel" in sys.modules
    sweep_dir = Path(out) if out is not None else default_sweep_dir(parsed)
    jobs = jobs or default_jobs()
    from fedskew.algorithms import external_methods

    # workers import the script only when a method of its own lives in it (pool.script_hidden)
    line = unguarded_script_line(sys._getframe(1)) if jobs > 1 and ray is None and \
        script_methods(external_methods()) else None
    if line is not None:
        from fedskew.config import ConfigError

        raise ConfigError(f"{sys.modules['__main__'].__file__}, line {line}, calls fedskew.sweep(jobs={jobs}) outside "
                          f"`if __name__ == \"__main__\":`; its worker processes start by importing the script, "
                          f"which would start the sweep again in each of them: put the call under that guard "
                          f"(or use jobs=1).")
    if on_progress is not None or progress:
        tracker, user_event = SweepProgress(planned_count(parsed), rounds_per_run(parsed)), on_event

        def on_event(kind: str, run: dict) -> None:
            if user_event is not None:
                user_event(kind, run)
            snap = tracker.update(kind, run)
            if on_progress is not None:
                on_progress(snap)
            if progress and tracker.line_due(kind):
                print(f"fedskew sweep: {progress_line(snap)}", file=sys.stderr, flush=True)

    db = run_sweep(parsed, sweep_dir, jobs, on_event, ray, pack)
    try:
        failed = db.execute("SELECT COUNT(*) FROM runs WHERE status='failed'").fetchone()[0]
    finally:
        db.close()
    if failed:
        warnings.warn(f"{failed} run(s) of the sweep in {sweep_dir} failed; fedskew.load_results lists their errors.",
                      stacklevel=2)
    return sweep_dir


def bench(suite: str, /, scale: str, *, data: str | Path | None = None, methods: list[str] | None = None,
          parts: list[str] | None = None, seeds: list[int] | None = None, settings: list[str] | None = None,
          jobs: int | None = None, out: str | Path | None = None, device: str | None = None,
          executor: str | None = None, pack: str | int = "auto", progress: bool | None = None) -> Path:
    """Run a benchmark suite (``fedskew bench SUITE --scale SCALE``) and write its leaderboard
    (``leaderboard.md`` and ``.html``); returns the suite folder (default
    ``runs/bench-<suite>-<scale>``). ``methods`` may name methods you registered
    (:func:`register_method`): they are tuned and ranked like the built-in ones. ``parts``,
    ``seeds`` and ``settings`` cut the suite as ``--parts``, ``--seeds`` and ``--settings`` do;
    ``device``, ``executor`` and ``pack`` say where and how the runs train. Running it again keeps
    the finished runs."""
    from fedskew.config import ConfigError
    from fedskew.experiments import bench as suites
    from fedskew.experiments.published import load as load_registry

    suites.check_suite(suite, scale)
    load_registry()
    if scale != "smoke" and not data:
        raise ConfigError(f"bench --scale {scale} reads its data sets from disk: give data=FOLDER.")
    known = __import__("fedskew.algorithms", fromlist=["registered"]).registered()
    unknown = [m for m in methods or [] if m not in known]
    if unknown:
        raise ConfigError(f"bench methods names {unknown[0]!r}, which is not a registered method; register it with "
                          f"fedskew.register_method first.")
    folder = suites.suite_dir(suite, scale, out)
    suites.claim_folder(folder, suite, scale, write=False)
    specs = suites.sweeps(suite, scale, str(data) if data else None, methods)
    if not specs:
        raise ConfigError(f"bench suite '{suite}' has none of the methods {methods} at scale {scale}.")
    specs = suites.restrict(specs, suite, parts, [str(x) for x in seeds] if seeds is not None else None,
                            {"device": device, "executor": executor}, settings)
    suites.claim_folder(folder, suite, scale)
    for part, spec in specs.items():
        sweep(spec, jobs, folder / suites.part_folder(part, scale), pack=pack, progress=progress)
    # the call that rebuilds it, with what made this one (the settings, out and the user's
    # module were dropped): `import MODULE; fedskew.bench(...)`
    from fedskew.algorithms import method_source

    given = {"data": str(data) if data else None, "methods": methods, "parts": parts, "seeds": seeds,
             "settings": settings, "out": str(out) if out is not None else None}
    modules = sorted(
        {src["module"] for m in methods or [] if (src := method_source(m)) and src["module"] != "__main__"}
    )
    command = "".join(f"import {m}; " for m in modules) + f"fedskew.bench({suite!r}, scale={scale!r}" + \
        "".join(f", {k}={v!r}" for k, v in given.items() if v is not None) + ")"
    suites.write_leaderboard(suite, scale, command, folder, methods)
    return folder


def report(sweep_dir: str | Path, out: str | Path | None = None, *, metric: str | None = None,
           baseline: str | None = None) -> tuple[Path, Path]:
    """Write a sweep's report (tables in the papers' layout and plots) as ``report.md`` and a
    self-contained ``report.html`` (default folder ``SWEEP_DIR/report``); returns both paths.
    ``metric`` (default ``global/test_acc_mean_last10``) and ``baseline`` (default ``fedavg``) as
    with ``fedskew report``."""
    from fedskew.experiments.report import write_report

    return write_report(sweep_dir, out, metric, baseline)


def load_results(sweep_dir: str | Path, *, rounds: bool = False, frame: bool | None = None):
    """A sweep's results as a table, one row per planned run: ``run_id``, ``label``, ``method``,
    ``partition``, ``seed``, ``status``, ``selected`` (the grid point the selection chose),
    ``error``, ``run_dir``, ``option/<name>`` per grid option, and every scalar of the run's
    summary (``global/test_acc_mean_last10``, ``personal/final_acc_after``, ...). Accuracies are
    fractions, as stored (0.8537 is the 85.37 % the tables print). ``rounds=True``: one row per
    finished run and round, with that round's metrics instead.

    A pandas DataFrame when pandas is installed (``frame=None``), else a list of dicts;
    ``frame=True``/``False`` asks for one of them."""
    from fedskew.experiments.selection import results_table

    rows = results_table(sweep_dir, rounds)
    if frame is False:
        return rows
    try:
        import pandas as pd
    except ImportError:
        if frame:
            raise ImportError("load_results(frame=True) needs pandas (`pip install pandas`).") from None
        return rows
    return pd.DataFrame(rows)


def methods() -> dict[str, type[Method]]:
    """Every method a config can name, built-in and registered: ``{name: class}``. A class's
    ``Options`` lists its options and defaults (``fedskew.methods()["fedmr"].Options()``)."""
    from fedskew.algorithms import registered

    return registered()


def register_method(cls: type[Method] | None = None, *, name: str | None = None):
    """Register a :class:`Method` subclass under ``name`` (default: its ``name`` attribute, else
    the lower-cased class name) so configs, both executors, sweeps and reports can use it; works
    as a decorator. Built-in names cannot be taken; registering a name again replaces your earlier
    class."""
    from fedskew.algorithms import register_method as register

    return register(cls, name=name)


__all__ = ["ClientReport", "ConfigError", "FederationInfo", "Forward", "Method", "RunConfig", "RunResult",
           "__version__", "bench", "load_config", "load_results", "methods", "register_method", "report", "resume",
           "run", "sweep"]
