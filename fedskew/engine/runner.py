"""The round loop: config -> federation + model + method -> rounds -> metrics in a run directory.

A run directory holds ``config.yaml`` (resolved, with seed and library version), ``partition.png``
and ``partition.json``, ``metrics.jsonl`` (one JSON object per round), ``summary.json`` (final
values) and ``checkpoint.pt`` (every ``checkpoint_every`` rounds, written atomically; the one
before is kept as ``checkpoint.prev.pt``). A checkpoint holds the global model, all server state
and every client's state (HPMs, control variates, FedDyn duals, ...); local optimisers start fresh
each round, and every random draw is a function of (seed, stream, round, client), so no generator
state is needed: ``resume`` continues exactly. Checkpoints are plain tensors and containers, loaded
with ``torch.load(weights_only=True)`` (nothing is unpickled).

Failures. A client whose training raises is reported in the round's ``clients_failed`` and left out
of the aggregation (``fail_fast=true`` stops instead); a NaN/inf local loss or aggregated model
stops the run with a message naming the round (counted from 1, as the progress lines do) and client,
and the `fedskew resume DIR lr=...` that continues from the last checkpoint.
"""

from __future__ import annotations

import errno
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import yaml

from fedskew import __version__
from fedskew.config import ConfigError, RunConfig
from fedskew.data.federated import Federation, load_federation
from fedskew.engine.durable import (FolderLock, append_line, atomic_save, atomic_write_text, blocking_file,
                                    read_records)
from fedskew.engine.local import LocalSettings, SequentialExecutor, federated_state, load_state, norm_names
from fedskew.engine.tracking import Trackers, check_available
from fedskew.methods import FederationInfo, build_method, method_model_defaults, method_validation_fraction
from fedskew.methods.base import model_part
from fedskew.metrics import (classifier_proxy_stats, count_floats, feature_stats, forgetting_degree, global_metrics,
                             mean_std)
from fedskew.models import build_model
from fedskew.models.functional import predict
from fedskew.streams import numpy_rng, sample_clients, seeded_torch


def resolve_device(name: str) -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"config key 'device' = '{name}' is not allowed: no CUDA device is available "
                          f"here; use device=cpu.")
    return torch.device(name)


def make_executor(cfg: RunConfig, model, fed: Federation, method, device):
    settings = LocalSettings(cfg.local_epochs, cfg.batch_size, cfg.momentum, cfg.weight_decay,
                             cfg.grad_clip, cfg.seed, 4 if cfg.dataset.augment else 0, cfg.precision)
    if cfg.executor == "vectorized":
        from fedskew.engine.vectorized import VectorizedExecutor

        return VectorizedExecutor(model, fed, method, settings, device, cfg.max_parallel_clients, cfg.pad_batches)
    return SequentialExecutor(model, fed, method, settings, device)


def environment(device: torch.device) -> dict:
    """What a result depends on beyond its config: library versions, the torch thread count (CPU
    kernels sum in another order with another count: the last digits move), the device and, in a
    git checkout of fedskew, the commit (``+dirty`` with uncommitted changes)."""
    import platform
    import subprocess

    env = {"fedskew": __version__, "python": platform.python_version(), "torch": str(torch.__version__),
           "numpy": str(np.__version__), "torch_threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    source = Path(__file__).resolve().parents[2]
    if (source / ".git").exists():
        try:
            commit = subprocess.run(["git", "-C", str(source), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                    text=True, timeout=10).stdout.strip()
            dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            if commit:
                env["git_commit"] = commit + ("+dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return env


@dataclass(repr=False)
class RunResult:
    """One finished run.

    - ``summary``: what ``summary.json`` holds (``global/test_acc`` and its best and mean over the
      last 10 evaluations, ``personal/*``, ``comm/*``, ``time/round_s_mean``, ...);
    - ``history``: one dict per round, as in ``metrics.jsonl`` (:meth:`curve` picks one metric);
    - ``global_state``: the final global model's tensors (parameters and floating-point buffers);
    - ``model``: the ``nn.Module`` holding ``global_state``, in eval mode;
    - ``run_dir`` and ``config`` (the validated :class:`~fedskew.config.RunConfig`);
    - ``environment``: where it ran (:func:`environment`), also in ``config.yaml``.
    """

    run_dir: Path
    summary: dict
    history: list[dict]
    global_state: dict
    config: RunConfig | None = None
    model: torch.nn.Module | None = None
    environment: dict | None = None

    def curve(self, key: str = "global/test_acc") -> list[tuple[int, float]]:
        """(round, value) of every round that reports ``key``."""
        return [(h["round"], h[key]) for h in self.history if h.get(key) is not None]

    def __repr__(self) -> str:
        acc = self.summary.get("global/test_acc")
        shown = "none" if acc is None else f"{acc:.4f}"
        return (f"RunResult({self.summary.get('method')} on {self.summary.get('dataset')}/"
                f"{self.summary.get('partition')}, seed {self.summary.get('seed')}, {len(self.history)} rounds, "
                f"global/test_acc {shown}, run_dir '{self.run_dir}')")


class Experiment:
    """One federated run. ``run()`` executes (or resumes) it and returns a :class:`RunResult`."""

    def __init__(self, cfg: RunConfig, run_dir: Path | None = None, resume: bool = False):
        self.cfg = cfg
        self.resume = resume
        self.group = None  # torch.distributed: this process's rank (distributed=true), else None
        if cfg.distributed:
            from fedskew.engine.distributed import setup

            self.group = setup(cfg.device)
        self.device = resolve_device(cfg.device)
        self.fed = load_federation(cfg)
        val_fraction = method_validation_fraction(cfg.method)
        if val_fraction > 0:  # the method's validation split, held out of training from the start
            self.fed = self.fed.with_validation(val_fraction, cfg.seed)
        if cfg.dataset.augment and self.fed.data.x_train.dim() != 4:
            raise ConfigError(f"dataset.augment = true needs images; dataset '{cfg.dataset.name}' has inputs of "
                              f"shape {tuple(self.fed.data.x_train.shape[1:])}.")
        with seeded_torch(cfg.seed, "model_init"):
            self.model = build_model(cfg.model, self.fed.data.input_shape, self.fed.num_classes, cfg.seed)
        self.model.to(self.device)
        self.info = FederationInfo(self.fed.num_clients, self.fed.num_classes,
                                   torch.from_numpy(self.fed.counts("train")), cfg.rounds,
                                   cfg.clients_per_round, cfg.seed,
                                   tuple(n for n, _ in self.model.named_parameters()), self.model.feature_dim,
                                   public_samples(self.fed, cfg.seed, self.device), cfg.local_epochs, cfg.batch_size,
                                   norm_names(self.model), model_caller(self.model),
                                   public_pool(self.fed, cfg.seed, self.device))
        self.method = build_method(cfg.method, self.info)
        need = self.method.requires_classifier
        if need is not None and need != cfg.model.classifier:
            raise ConfigError(f"method '{cfg.method.name}' needs model.classifier = '{need}', not "
                              f"'{cfg.model.classifier}'.")
        if cfg.model.private_expert and method_model_defaults(cfg.method).get("private_expert") is not True:
            raise ConfigError(f"model.private_expert = true is FLDA's architecture, whose private model and gate only "
                              f"method flda keeps on the clients; method '{cfg.method.name}' would send and average "
                              f"them: use method=flda or model.private_expert=false.")
        self.executor = make_executor(cfg, self.model, self.fed, self.method, self.device)
        if self.group is not None:
            if self.group.rank > 0:
                return  # a worker rank: it trains what rank 0 sends (run) and writes nothing
            from fedskew.engine.distributed import DistributedExecutor

            self.executor = DistributedExecutor(self.executor, self.group, self.device)
        self.x_test = self.fed.data.x_test.to(self.device)
        self.y_test = self.fed.data.y_test.to(self.device)
        self.run_dir = Path(run_dir) if run_dir else default_run_dir(cfg)
        self.changes: dict = {}  # settings changed at this resume (fedskew resume DIR key=value)
        self.environment = environment(self.device)
        check_available(cfg.logger)
        blocked = blocking_file(self.run_dir)
        if blocked is not None:
            key = "out_dir" if run_dir is None else "the run directory"
            raise ConfigError(f"{key} '{self.run_dir if run_dir else cfg.out_dir}' cannot hold a run: '{blocked}' is a "
                              f"file, not a folder; choose another out_dir.")
        if self.run_dir.is_dir() and os.access(self.run_dir, os.W_OK):
            FolderLock(self.run_dir, "run directory").acquire().release()  # in use by a running process?
        if not resume and (self.run_dir / "metrics.jsonl").exists():
            raise ConfigError(f"run directory '{self.run_dir}' already holds a run; continue it with "
                              f"`fedskew resume {self.run_dir}` or choose another run_name.")

    # -- files ---------------------------------------------------------------------------------
    def _prepare_dir(self) -> None:
        record = {**self.cfg.resolved(), "environment": self.environment}
        old = self.run_dir / "config.yaml"
        if self.resume and old.is_file():  # a resumed run keeps where its earlier parts ran
            before = yaml.safe_load(old.read_text()) or {}
            previous = before.get("environment_previous", [])
            if before.get("environment") not in (None, self.environment):
                previous = [*previous, before["environment"]]
            if previous:
                record["environment_previous"] = previous
            if before.get("changes"):
                record["changes"] = before["changes"]
        atomic_write_text(yaml.safe_dump(record, sort_keys=False), self.run_dir / "config.yaml")
        (self.run_dir / "partition.json").write_text(json.dumps(self.fed.summary_rows()))
        self.fed.heatmap(self.run_dir / "partition.png",
                         f"{self.cfg.dataset.name} / {self.cfg.partition.name}: "
                         f"{self.fed.num_clients} clients")

    def _checkpoint(self, state: dict) -> None:
        """Write ``checkpoint.pt`` (atomic, fsynced); the one before becomes ``checkpoint.prev.pt``,
        but only when it is known to read back: a corrupt one is dropped, never rotated over the
        good backup."""
        path = self.run_dir / "checkpoint.pt"
        if path.exists():
            if self._current_checkpoint_ok:
                os.replace(path, self.run_dir / "checkpoint.prev.pt")
            else:
                path.unlink()
        atomic_save(state, path)
        self._current_checkpoint_ok = True
        self._checkpoint_round = state["next_round"]

    def _divergence_advice(self) -> str:
        """What can be done after a divergence, given what is on disk."""
        if self._checkpoint_round:
            return (f"the checkpoint after round {self._checkpoint_round} is kept: `fedskew resume {self.run_dir} "
                    f"lr=<smaller>` (or grad_clip=<norm>) continues from it.")
        return "no checkpoint was written yet: start again with a smaller lr or with grad_clip set."

    def _load_checkpoint(self) -> dict | None:
        """The newest readable checkpoint: ``checkpoint.pt``, else (truncated or corrupt, with a
        notice) ``checkpoint.prev.pt``; None when the run never wrote one."""
        paths = [p for p in (self.run_dir / "checkpoint.pt", self.run_dir / "checkpoint.prev.pt") if p.exists()]
        errors = []
        expected = {k: v.shape for k, v in federated_state(self.model).items()}
        for path in paths:
            try:
                ckpt = torch.load(path, map_location=self.device, weights_only=True)
                if not isinstance(ckpt, dict) or "next_round" not in ckpt:
                    raise ValueError("it is not a fedskew checkpoint")
                if any(expected.get(k) != v.shape for k, v in ckpt["global_state"].items()):
                    raise ValueError("it holds another model's tensors")
            except Exception as exc:  # empty, truncated, corrupt or foreign file: try the previous one
                reason = (str(exc).splitlines() or [""])[0][:120] or type(exc).__name__
                errors.append(f"{path.name}: {reason}")
                print(f"fedskew: cannot read {path} ({reason}); trying the previous checkpoint.", flush=True)
                continue
            self._current_checkpoint_ok = path.name == "checkpoint.pt"
            self._checkpoint_round = ckpt["next_round"]
            return ckpt
        if errors:
            raise ConfigError(f"no readable checkpoint in '{self.run_dir}' ({'; '.join(errors)}); remove the "
                              f"directory (or choose another run_name) and start the run again.")
        return None

    # -- the loop ------------------------------------------------------------------------------
    @property
    def worker(self) -> bool:
        """A rank > 0 of a distributed run: it trains shards for rank 0 and returns no result."""
        return self.group is not None and self.group.rank > 0

    def run(self, on_round: Callable[[dict], None] | None = None) -> RunResult | None:
        """Execute (or resume) the run; the run directory is locked for this process meanwhile."""
        if self.group is not None:
            from fedskew.engine.distributed import serve, teardown

            try:
                if self.worker:
                    return serve(self.executor, self.group, self.device)
                return self._run_locked(on_round)
            finally:
                if not self.worker:
                    self.executor.stop()
                teardown()
        return self._run_locked(on_round)

    def _run_locked(self, on_round) -> RunResult:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the run directory '{self.run_dir}' ({exc.strerror}); choose another "
                              f"out_dir.") from None
        try:
            lock = FolderLock(self.run_dir, "run directory").acquire()
        except OSError as exc:
            raise StorageError(f"cannot write in the run directory '{self.run_dir}' ({exc.strerror}); choose another "
                               f"out_dir.") from None
        try:
            if not self.resume and (self.run_dir / "metrics.jsonl").exists():  # checked again under the lock
                raise ConfigError(f"run directory '{self.run_dir}' already holds a run; continue it with "
                                  f"`fedskew resume {self.run_dir}` or choose another run_name.")
            return self._run(on_round)
        except OSError as exc:  # a full disk, a read-only or vanished folder: nothing written is lost
            if exc.errno not in STORAGE_ERRNOS:
                raise
            raise StorageError(f"writing the run directory '{self.run_dir}' failed ({exc.strerror or exc}); fix that "
                               f"and `fedskew resume {self.run_dir}` continues from the last checkpoint.") from None
        finally:
            lock.release()

    def _history_before(self, start: int) -> list[dict]:
        """Rounds 0 .. start-1 of ``metrics.jsonl``, each exactly once (a torn last line dropped);
        anything else means two processes wrote the directory or the file was edited."""
        history = [h for h in read_records(self.run_dir / "metrics.jsonl") if h["round"] < start]
        rounds = [h["round"] for h in history]
        if rounds != list(range(start)):
            missing = sorted(set(range(start)) - set(rounds))
            twice = sorted({r for r in rounds if rounds.count(r) > 1})
            raise ConfigError(f"cannot resume '{self.run_dir}': its checkpoint is after round {start} but "
                              f"metrics.jsonl "
                              f"{'lacks rounds ' + str([r + 1 for r in missing[:10]]) if missing else ''}"
                              f"{' and ' if missing and twice else ''}"
                              f"{'holds rounds ' + str([r + 1 for r in twice[:10]]) + ' twice' if twice else ''} "
                              f"(two processes wrote it, or it was edited); start the run again in a new directory.")
        return history

    def _run(self, on_round) -> RunResult:
        cfg, method = self.cfg, self.method
        self._current_checkpoint_ok, self._checkpoint_round = False, 0
        self._prepare_dir()
        ckpt = self._load_checkpoint() if self.resume else None
        if ckpt is not None:
            start, global_state = ckpt["next_round"], ckpt["global_state"]
            server_state, client_states, totals = ckpt["server_state"], ckpt["client_states"], ckpt["totals"]
            history = self._history_before(start)
            if self.changes:  # settings changed at this resume, from round start + 1 (counted from 1)
                path = self.run_dir / "config.yaml"
                record = yaml.safe_load(path.read_text())
                record["changes"] = [*record.get("changes", []), {"from_round": start + 1, **self.changes}]
                atomic_write_text(yaml.safe_dump(record, sort_keys=False), path)
        else:
            start, history = 0, []
            global_state = federated_state(self.model)
            server_state = method.server_init(global_state, self.info)
            client_states, totals = {}, {"up": 0, "down": 0, "up_model": 0, "down_model": 0}
        atomic_write_text("".join(json.dumps(h) + "\n" for h in history), self.run_dir / "metrics.jsonl")
        trackers = Trackers(cfg, self.run_dir, start)
        summary = None
        try:
            summary, global_state = self._rounds(start, history, global_state, server_state, client_states, totals,
                                                 trackers, on_round)
        finally:
            trackers.finish(summary)
        names = set(self.model.state_dict())
        load_state(self.model, {k: v for k, v in global_state.items() if k in names})
        self.model.eval()
        return RunResult(self.run_dir, summary, history, global_state, cfg, self.model, self.environment)

    def _rounds(self, start, history, global_state, server_state, client_states, totals, trackers,
                 on_round) -> tuple[dict, dict]:
        """Rounds ``start`` .. the last (records appended to ``history``), then the summary; returns
        (summary, final global state)."""
        cfg = self.cfg
        for t in range(start, cfg.rounds):
            record = self._round(t, global_state, server_state, client_states, totals)
            global_state, server_state = record.pop("_global"), record.pop("_server")
            history.append(record)
            append_line(record, self.run_dir / "metrics.jsonl")
            if (t + 1) % cfg.checkpoint_every == 0 or t == cfg.rounds - 1:
                self._checkpoint({"next_round": t + 1, "global_state": global_state, "server_state": server_state,
                                  "client_states": client_states, "totals": totals})
            trackers.log(record)
            if on_round:
                on_round(record)

        summary = self._summary(history, global_state, server_state, client_states, totals)
        atomic_write_text(json.dumps(summary, indent=2), self.run_dir / "summary.json")
        return summary, global_state

    def _round(self, t, global_state, server_state, client_states, totals) -> dict:
        cfg, method = self.cfg, self.method
        t0 = time.perf_counter()
        selected = sample_clients(cfg.seed, t, self.fed.num_clients, cfg.clients_per_round)
        for k in selected:
            if k not in client_states:
                client_states[k] = method.client_init(k, global_state, self.info)
        payload = method.broadcast(global_state, server_state)
        lr = cfg.lr * cfg.lr_decay ** t
        t1 = time.perf_counter()
        # Persistent client states (HPMs, control variates, previous models) live in host memory
        # between rounds; only the selected clients' states visit the device.
        on_device = {k: _to(client_states[k], self.device) for k in selected}
        downloads = {k: method.download(server_state, k, t) for k in selected}
        for k, extra in downloads.items():
            on_device[k].update(_to(extra, self.device))
        results, failed = self._train(t, selected, payload, on_device, lr)
        train_s = time.perf_counter() - t1
        for r in results:
            if not math.isfinite(r.train_loss):
                raise FloatingPointError(f"round {t + 1}: client {r.client_id}'s local loss is {r.train_loss} "
                                         f"(training diverged); {self._divergence_advice()}")
            client_states[r.client_id] = _to(r.client_state, torch.device("cpu"))
        uploads = [r.upload for r in results]
        reports = [r.report for r in results]
        new_global, new_server = method.aggregate(server_state, global_state, uploads, reports)
        if not all(torch.isfinite(v).all() for v in new_global.values() if v.is_floating_point()):
            raise FloatingPointError(f"round {t + 1}: the aggregated model holds NaN or inf (training diverged); "
                                     f"{self._divergence_advice()}")
        down = count_floats(payload) * len(selected) + sum(count_floats(d) for d in downloads.values())
        if t == 0:  # fixed architecture tensors (the ETF head): counted once, as if sent at setup
            down += sum(v.numel() for k, v in self.model.state_dict().items() if k in self.model.fixed_keys)
        up = sum(count_floats(u) for u in uploads)
        down_model = down - count_floats({k: v for k, v in payload.items() if not k.startswith("model.")}) * len(selected)
        up_model = sum(count_floats(model_part(u)) for u in uploads)
        totals["down"] += down
        totals["up"] += up
        totals["down_model"] += down_model
        totals["up_model"] += up_model
        n = sum(r.report.num_samples for r in results)
        samples_seen = sum(r.report.num_samples * cfg.local_epochs for r in results)
        before, before_std = mean_std([r.acc_before for r in results])
        after, after_std = mean_std([r.acc_after for r in results])
        record = {
            "round": t, "clients": selected, "clients_failed": failed, "lr": lr,
            "train/loss": sum(r.train_loss * r.report.num_samples for r in results) / n,
            "personal/acc_before": before, "personal/acc_before_std": before_std,
            "personal/acc_after": after, "personal/acc_after_std": after_std,
            **{f"train/{key}": sum(r.aux[key] * r.report.num_samples for r in results if key in r.aux) /
               sum(r.report.num_samples for r in results if key in r.aux)
               for key in sorted({k for r in results for k in r.aux})},
            "comm/down_floats": down, "comm/up_floats": up,
            "comm/down_extra_floats": down - down_model, "comm/up_extra_floats": up - up_model,
            "comm/down_floats_total": totals["down"], "comm/up_floats_total": totals["up"],
            "time/client_train_s": train_s, "time/samples_per_s": samples_seen / max(train_s, 1e-9),
        }
        evaluate = (t + 1) % cfg.eval_every == 0 or t == cfg.rounds - 1
        if evaluate and not method.has_global_model:
            record["global/test_acc"] = None  # no model serves the global test set (FedProto, FedRep)
        elif evaluate:
            record.update(global_metrics(self.model, new_global, self.x_test, self.y_test, self.fed.num_classes))
            if self.fed.data.x_val is not None:
                x_val, y_val = self.fed.data.x_val.to(self.device), self.fed.data.y_val.to(self.device)
                record["global/val_acc"] = (predict(self.model, new_global, x_val) == y_val).float().mean().item()
            if cfg.feature_stats:
                record.update(feature_stats(self.model, new_global, self.x_test))
        record["memory/client_state_bytes"] = sum(v.numel() * v.element_size() for st in client_states.values()
                                                  for v in st.values())
        if cfg.classifier_stats:
            record.update(self._proxy_stats(payload, results, lr))
        if cfg.forgetting_stats:
            record.update(self._forgetting(payload, results))
        peak = getattr(self.executor, "peak_state_bytes", 0)
        if peak:
            record["memory/peak_state_bytes"] = peak
        if getattr(self.executor, "round_peak_bytes", None) is not None:  # the device allocator's peak (CUDA)
            record["memory/peak_device_bytes"] = self.executor.round_peak_bytes
        record["time/round_s"] = time.perf_counter() - t0
        record["_global"], record["_server"] = new_global, new_server
        return record

    def _train(self, t, selected, payload, states, lr):
        """Train the selected clients; a client whose training raises is reported (``clients_failed``)
        and left out, unless ``fail_fast``. On a failure the round is retried client by client on
        the sequential executor, so the others' results are exactly what they would have been."""
        try:
            # an executor that loses clients itself (Flower: a node that does not answer) lists them
            # in ``failed`` and returns the others
            return self.executor.train_round(t, selected, payload, states, lr), list(getattr(self.executor, "failed", []))
        except ClientFailure:
            raise
        except Exception:
            can_retry = hasattr(self.executor, "train_client") or hasattr(self.executor, "sequential")
            if self.cfg.fail_fast or not can_retry:
                raise
        sequential = getattr(self.executor, "sequential", self.executor)
        results, failed = [], []
        for k in selected:
            try:
                results.append(sequential.train_client(t, k, payload, states[k], lr))
            except Exception as exc:
                message = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                failed.append({"client": k, "error": message})
                print(f"fedskew: round {t + 1}: client {k} failed and is left out of the aggregation ({message})",
                      flush=True)
        if not results:
            raise ClientFailure(f"round {t + 1}: every selected client failed; the first error was "
                                f"{failed[0]['error']}")
        return results, failed

    def _proxy_stats(self, payload, results, lr) -> dict:
        """``proxy/*``: MAP Figure 6 statistics of each uploaded classifier, mean over clients."""
        key = "model.classifier.weight"
        values: dict[str, list[float]] = {}
        for r in results:
            if key in payload and key in r.upload:
                observed = self.info.class_counts[r.client_id] > 0
                stats = classifier_proxy_stats(payload[key], r.upload[key], observed.to(payload[key].device), lr)
                for k, v in stats.items():
                    values.setdefault(k, []).append(v)
        return {f"proxy/{k}": sum(v) / len(v) for k, v in sorted(values.items())}

    def _forgetting(self, payload, results) -> dict:
        """``forgetting/*``: FedKA's forgetting degree (Eq. 1) of each selected client's uploaded
        model vs the global model it received, per class on the global test set; the mean over
        (client, class) pairs of each class role (roles with the method's gamma, else 1/C), and the
        per-class values per client."""
        from fedskew.methods.fedka import ROLE_NAMES, class_roles

        C = self.fed.num_classes
        gamma = getattr(self.method.opt, "gamma", None) or 1.0 / C
        n = self.cfg.forgetting_test_samples
        x_test, y_test = self.x_test[:n], self.y_test[:n]
        present = torch.bincount(y_test, minlength=C) > 0

        def class_acc(state):
            preds = predict(self.model, state, x_test)
            correct = torch.bincount(y_test[preds == y_test], minlength=C).double()
            return correct / torch.bincount(y_test, minlength=C).clamp(min=1).double()

        global_acc = class_acc(model_part(payload))
        by_role: dict[int, list[float]] = {0: [], 1: [], 2: []}
        per_client = {}
        for r in results:
            tau = forgetting_degree(global_acc, class_acc(model_part(r.upload)))
            roles = class_roles(self.info.class_counts[r.client_id], gamma)
            for c in range(C):
                # Where the global model has 0 accuracy there is nothing to forget and Eq. 1 gives
                # -acc_local / xi (about -1e8): such pairs stay in per_client, not in the means.
                if present[c] and global_acc[c] > 0:
                    by_role[int(roles[c])].append(float(tau[c]))
            per_client[str(r.client_id)] = [float(t) if present[c] else None for c, t in enumerate(tau)]
        out = {f"forgetting/{ROLE_NAMES[role]}": (sum(v) / len(v) if v else None) for role, v in by_role.items()}
        out["forgetting/per_client"] = per_client
        out["forgetting/global_class_acc"] = global_acc.tolist()  # the reference of Eq. 1
        return out

    def _final_personalization(self, global_state, server_state, client_states) -> dict:
        """Every client receives the final global model and trains once (no aggregation, no state
        kept): ``personal/final_acc_before`` and ``personal/final_acc_after`` over all clients."""
        cfg = self.cfg
        clients = list(range(self.fed.num_clients))
        states = {k: _to(client_states[k], self.device) if k in client_states
                  else self.method.client_init(k, global_state, self.info) for k in clients}
        payload = self.method.broadcast(global_state, server_state)
        for k in clients:
            states[k] = {**states[k], **_to(self.method.download(server_state, k, cfg.rounds), self.device)}
        results = self.executor.train_round(cfg.rounds, clients, payload, states, cfg.lr * cfg.lr_decay ** cfg.rounds)
        before, before_std = mean_std([r.acc_before for r in results])
        after, after_std = mean_std([r.acc_after for r in results])
        return {"personal/final_acc_before": before, "personal/final_acc_before_std": before_std,
                "personal/final_acc_after": after, "personal/final_acc_after_std": after_std,
                # per client, in client order (the fairness histogram of MAP Figure 10)
                "personal/final_acc_before_per_client": [r.acc_before for r in results],
                "personal/final_acc_after_per_client": [r.acc_after for r in results]}

    def _summary(self, history, global_state, server_state, client_states, totals) -> dict:
        evals = [h for h in history if h.get("global/test_acc") is not None]
        if evals:
            last = evals[-1]
            accs = [h["global/test_acc"] for h in evals]
            best = max(range(len(accs)), key=accs.__getitem__)
            global_summary = {
                "global/test_acc": last["global/test_acc"],
                "global/test_acc_best": accs[best], "global/test_acc_best_round": evals[best]["round"],
                "global/test_acc_mean_last10": sum(accs[-10:]) / len(accs[-10:]),
                **{k: v for k, v in last.items() if k.startswith("global/class_acc/")}}
            vals = [h["global/val_acc"] for h in evals if "global/val_acc" in h]
            if vals:
                global_summary.update({"global/val_acc": vals[-1], "global/val_acc_mean_last10": sum(vals[-10:]) /
                                       len(vals[-10:])})
        else:  # the method has no global model
            global_summary = {k: None for k in ("global/test_acc", "global/test_acc_best",
                                                "global/test_acc_best_round", "global/test_acc_mean_last10")}
        model_total = totals["up_model"] + totals["down_model"]
        summary = {
            "method": self.cfg.method.name, "dataset": self.cfg.dataset.name,
            "partition": self.cfg.partition.name, "model": self.cfg.model.name, "seed": self.cfg.seed,
            "rounds": self.cfg.rounds,
            **global_summary,
            "personal/acc_before": history[-1]["personal/acc_before"],
            "personal/acc_after": history[-1]["personal/acc_after"],
            "comm/down_floats_total": history[-1]["comm/down_floats_total"],
            "comm/up_floats_total": history[-1]["comm/up_floats_total"],
            # Extra communication beyond the model, in % of the model's (FedMR Table 3).
            # (None when no model is exchanged at all: FedProto)
            "comm/extra_pct": 100.0 * (totals["up"] + totals["down"] - model_total) / model_total if model_total else None,
            "time/round_s_mean": sum(h["time/round_s"] for h in history) / len(history),
            "train/loss": history[-1]["train/loss"],
        }
        if self.cfg.final_personalization and self.cfg.partition.local_test_fraction > 0:
            summary.update(self._final_personalization(global_state, server_state, client_states))
        return summary


STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EIO}


class StorageError(ConfigError):
    """The run directory cannot be written (full disk, permissions); one sentence, resumable."""


class ClientFailure(RuntimeError):
    """Every selected client of a round failed."""


def public_samples(fed: Federation, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One training sample per class drawn once from the seed (stream ``public_samples``): the
    minimal shared set FedKA assumes every client knows (``FederationInfo.public_samples``); None
    when some class has no training sample (Shakespeare's rare characters)."""
    rng = numpy_rng(seed, "public_samples")
    y = fed.data.y_train.numpy()
    picks = [int(rng.choice(np.flatnonzero(y == c))) if (y == c).any() else -1 for c in range(fed.num_classes)]
    if min(picks) < 0:
        return None
    idx = torch.tensor(picks)
    return fed.data.x_train[idx].to(device), fed.data.y_train[idx].to(device)


def public_pool(fed: Federation, seed: int, device: torch.device) -> Callable[[str], torch.Tensor]:
    """``source -> x``: the inputs of the global ``test`` set or the pooled ``train`` set, without
    labels, in an order drawn once from the seed (stream ``public_unlabelled_<source>``); a method
    takes its public set as the first n (``FederationInfo.public_pool``)."""
    def draw(source: str) -> torch.Tensor:
        x = fed.data.x_test if source == "test" else fed.data.x_train
        order = numpy_rng(seed, f"public_unlabelled_{source}").permutation(len(x))
        return x[torch.from_numpy(order)].to(device)
    return draw


def model_caller(model: torch.nn.Module) -> Callable:
    """``(state, x, train=False) -> (z, logits)``: ``model``'s architecture on ``state``, differentiable
    in it; buffers ``state`` lacks come from the model, and none is updated
    (``FederationInfo.model_call``)."""
    from torch.func import functional_call

    from fedskew.models.functional import in_eval_mode

    def call(state: dict, x: torch.Tensor, train: bool = False):
        buffers = dict(model.named_buffers())  # cloned: a train-mode BatchNorm must update neither
        full = {**state, **{k: state.get(k, v).clone() for k, v in buffers.items()}}
        if train:
            return functional_call(model, full, (x,), {"return_features": True})
        return in_eval_mode(model, lambda: functional_call(model, full, (x,), {"return_features": True}))
    return call


def _to(state: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in state.items()}


def default_run_dir(cfg: RunConfig) -> Path:
    name = cfg.run_name or (f"{cfg.method.name}-{cfg.dataset.name}-{cfg.partition.name}-s{cfg.seed}-"
                            f"{time.strftime('%Y%m%d-%H%M%S')}")
    return Path(cfg.out_dir) / name


def run(cfg: RunConfig, run_dir: Path | None = None, on_round=None) -> RunResult:
    return Experiment(cfg, run_dir).run(on_round)


# Settings a run may change when resumed (`fedskew resume DIR lr=0.005`): how it is optimised from now
# on, evaluated and recorded; not what it is (data, partition, model, method, seed).
RESUMABLE = ("lr", "lr_decay", "grad_clip", "rounds", "eval_every", "checkpoint_every", "fail_fast", "logger",
             "final_personalization", "device", "executor", "distributed", "max_parallel_clients", "pad_batches", "precision", "feature_stats",
             "classifier_stats", "forgetting_stats", "forgetting_test_samples")


def resume(run_dir: str | Path, on_round=None, changes: dict | list[str] | None = None) -> RunResult:
    """Continue an interrupted run from its directory's ``checkpoint.pt`` and ``config.yaml``;
    ``changes`` (``{"lr": 0.005}`` or ``["lr=0.005"]``) alters settings of :data:`RESUMABLE` from
    the next round on, recorded in config.yaml's ``changes``."""
    from fedskew.config import did_you_mean, parse_override, read_config_file, set_key, validate_config

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
