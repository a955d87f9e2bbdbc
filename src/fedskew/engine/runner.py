"""The round loop and nothing else: config -> federation + model + method -> rounds -> metrics.

Each round: sample clients, :func:`~fedskew.engine.protocol.dispatch` (broadcast + downloads),
the executor trains them (:func:`~fedskew.engine.protocol.client_round`), ``aggregate``, evaluate,
append the round's record to the run directory (:mod:`fedskew.engine.rundir`) and checkpoint. A
checkpoint holds the global model, all server state and every client's state; local optimisers
start fresh each round, and every random draw is a function of (seed, stream, round, client), so no
generator state is needed: a resumed run (:mod:`fedskew.engine.resume`) continues exactly.

Failures. A client whose training raises is reported in the round's ``clients_failed`` and left out
of the aggregation (``fail_fast=true`` stops instead); a NaN/inf local loss or aggregated model
stops the run with a message naming the round (counted from 1, as the progress lines do) and client,
and the `fedskew resume DIR lr=...` that continues from the last checkpoint.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fedskew.algorithms import (
    FederationInfo,
    build_method,
    build_method_model,
    method_source,
    method_validation_fraction,
)
from fedskew.algorithms.base import model_part
from fedskew.config import ConfigError, RunConfig
from fedskew.data.federated import load_federation, public_pool, public_samples
from fedskew.engine.durable import (
    LOCK_NAME,
    STOP,
    FolderLock,
    RunInterrupted,
    append_line,
    atomic_write_text,
    blocking_file,
    signals_held,
)
from fedskew.engine.lanes import LaneExecutor
from fedskew.engine.local import SequentialExecutor, federated_state, load_state
from fedskew.engine.protocol import LocalSettings, dispatch, local_budget, to_device
from fedskew.engine.rundir import (
    STORAGE_ERRNOS,
    ClientStates,
    RunDir,
    RunResult,
    RunSummary,
    StorageError,
    compact,
    default_run_dir,
    environment,
    run_identity,
)
from fedskew.engine.tracking import Trackers, check_available
from fedskew.engine.vectorized import VectorizedExecutor, cpu_convolutions_alone
from fedskew.files import read_json
from fedskew.metrics import (
    client_means,
    communication,
    feature_stats,
    forgetting_record,
    global_metrics,
    mean_std,
    proxy_record,
    run_summary,
)
from fedskew.models import build_model
from fedskew.models.functional import model_caller, norm_names, predict
from fedskew.streams import dropped_clients, held_out_clients, sample_clients, seeded_torch


def resolve_device(name: str) -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"config key 'device' = '{name}' is not allowed: no CUDA device is available "
                          f"here; use device=cpu.")
    return torch.device(name)


class Experiment:
    """One federated run. ``run()`` executes (or resumes) it and returns a :class:`RunResult`."""

    def __init__(self, cfg: RunConfig, run_dir: Path | None = None, resume: bool = False, pack=None):
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
            def configured():
                return build_model(cfg.model, self.fed.data.input_shape, self.fed.num_classes, cfg.seed)

            base = configured()
            try:
                self.model = build_method_model(cfg.method, cfg.model.classifier, base, configured,
                                                self.fed.num_clients)
            except ValueError as exc:  # a method that needs the other classifier
                raise ConfigError(str(exc).rstrip(".") + ".") from None
        self.model.to(self.device)
        self.info = FederationInfo(
            num_clients=self.fed.num_clients, num_classes=self.fed.num_classes,
            class_counts=torch.from_numpy(self.fed.counts("train")), rounds=cfg.rounds,
            clients_per_round=cfg.clients_per_round, seed=cfg.seed,
            param_names=tuple(n for n, _ in self.model.named_parameters()), feature_dim=self.model.feature_dim,
            public_samples=public_samples(self.fed, cfg.seed, self.device), local_epochs=cfg.local_epochs,
            batch_size=cfg.batch_size, norm_names=norm_names(self.model), model_call=model_caller(self.model),
            public_pool=public_pool(self.fed, cfg.seed, self.device),
            fixed_state={k: v.clone() for k, v in self.model.state_dict().items() if k in self.model.fixed_keys},
            param_numel=sum(p.numel() for p in self.model.parameters()),
            model_draw=functools.partial(self._draw_model, configured))
        try:
            self.method = build_method(cfg.method, self.info)
        except ValueError as exc:  # a method's own check of the federation or model (one sentence)
            raise ConfigError(str(exc).rstrip(".") + ".") from None
        self.pack = pack  # runs as lanes (fedskew.engine.lanes): its stop flag is read once per step of the pack
        # what the run is, as its checkpoints record it: computed once here, never inside the round loop,
        # where a Ctrl-C landing in pydantic's model_dump came out as a PydanticSerializationError (exit 1)
        self.identity = run_identity(cfg)
        self.executor = make_executor(cfg, self.model, self.fed, self.method, self.device, pack)
        if self.group is not None:
            if self.group.rank > 0:
                return  # a worker rank: it trains what rank 0 sends (run) and writes nothing
            from fedskew.engine.distributed import DistributedExecutor

            self.executor = DistributedExecutor(self.executor, self.group, self.device)
        self.x_test = self.fed.data.x_test.to(self.device)
        self.y_test = self.fed.data.y_test.to(self.device)
        self.run_dir = Path(run_dir) if run_dir else default_run_dir(cfg)
        self.files = RunDir(self.run_dir)
        self.changes: dict = {}  # settings changed at this resume (fedskew resume DIR key=value)
        self.environment = environment(self.device)
        self.environment["executor"] = "vectorized" if pack is not None else \
            executor_name(cfg, self.model, self.method, self.device)  # (``auto`` resolved)
        check_available(cfg.logger)
        blocked = blocking_file(self.run_dir)
        if blocked is not None:
            key = "out_dir" if run_dir is None else "the run directory"
            raise ConfigError(f"{key} '{self.run_dir if run_dir else cfg.out_dir}' cannot hold a run: '{blocked}' is a "
                              f"file, not a folder; choose another out_dir.")
        if self.run_dir.is_dir() and os.access(self.run_dir, os.W_OK) and (resume or not self._foreign()):
            FolderLock(self.run_dir, "run directory").check_free()  # in use by a running process?
        if not resume:
            self._refuse_existing()

    def _foreign(self) -> list[str]:
        """What the run directory holds when it exists and is not a run's (else nothing)."""
        entries = sorted(p.name for p in self.run_dir.iterdir() if p.name != LOCK_NAME) if self.run_dir.is_dir() else []
        return [] if {"metrics.jsonl", "config.yaml", "run.json"} & set(entries) else entries

    def _refuse_existing(self) -> None:
        """A new run never writes into a folder that holds anything: another run (resume it) or files
        that are not a run's (a run_name naming an existing folder would overwrite them)."""
        foreign = self._foreign()
        if foreign:
            raise ConfigError(f"run directory '{self.run_dir}' already exists and is not a fedskew run (it holds "
                              f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); choose another "
                              f"run_name or out_dir.")
        if any((self.run_dir / name).exists() for name in ("metrics.jsonl", "config.yaml", "run.json")):
            raise ConfigError(f"run directory '{self.run_dir}' already holds a run; continue it with "
                              f"`fedskew resume {self.run_dir}` or choose another run_name.")

    # the resumable settings that change results, recorded in every checkpoint: a resume whose
    # config.yaml was edited by hand records the edit as a change, as `resume DIR key=value` does
    RESULT_SETTINGS = ("lr", "lr_decay", "lr_decay_every", "lr_schedule", "lr_min", "grad_clip", "precision",
                       "final_personalization", "device", "executor", "distributed", "max_parallel_clients",
                       "pad_batches", "compile", "channels_last")

    def _settings(self) -> dict:
        dumped = self.cfg.model_dump(mode="json")
        return {k: dumped[k] for k in self.RESULT_SETTINGS}

    def _checkpoint(self, state: dict) -> None:
        self.files.checkpoint({**state, "run": self.identity, "token": self.files.record().get("token"),
                               "settings": self._settings()})

    # -- the loop ------------------------------------------------------------------------------
    @property
    def worker(self) -> bool:
        """A rank > 0 of a distributed run: it trains shards for rank 0 and returns no result."""
        return self.group is not None and self.group.rank > 0

    def _draw_model(self, configured: Callable, j: int) -> dict:
        """FederationInfo.model_draw: the run's model built again from stream ``method_models``, j."""
        with seeded_torch(self.cfg.seed, "method_models", j):
            model = build_method_model(self.cfg.method, self.cfg.model.classifier, configured(), configured,
                                       self.fed.num_clients)
        return {k: v.to(self.device) for k, v in federated_state(model).items()}

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
            if not self.resume:  # checked again under the lock
                self._refuse_existing()
            return self._run(on_round)
        except OSError as exc:  # a full disk, a read-only or vanished folder: nothing written is lost
            if exc.errno not in STORAGE_ERRNOS:
                raise
            raise StorageError(f"writing the run directory '{self.run_dir}' failed ({exc.strerror or exc}); fix that "
                               f"and `fedskew resume {self.run_dir}` continues from the last checkpoint.") from None
        finally:
            lock.release()

    def _run(self, on_round) -> RunResult:
        cfg, method = self.cfg, self.method
        # the writes that make the folder the run's, through its first checkpoint, are not split by a Ctrl-C or a
        # SIGTERM (held until they are done): a folder that holds anything of a run holds a checkpoint of it, which
        # is what shows a resume that the folder is the run's (RunDir.proves)
        with signals_held():
            self.files.write_identity(self.identity, method_source(cfg.method.name))
            self.files.write_record(cfg, self.environment, self.resume)
            self.files.write_partition(
                self.fed, f"{cfg.dataset.name} / {cfg.partition.name}: {self.fed.num_clients} clients"
            )
            ckpt = self._load_checkpoint() if self.resume else None
            if ckpt is None:
                start, history = 0, []
                global_state = federated_state(self.model)
                server_state = method.server_init(global_state, self.info)
                client_states, totals = ClientStates(), {"up": 0, "down": 0, "up_model": 0, "down_model": 0}
                self._checkpoint({"next_round": 0, "global_state": global_state, "server_state": server_state,
                                  "client_states": client_states, "totals": totals})
        if ckpt is not None:
            start, global_state = ckpt["next_round"], ckpt["global_state"]
            server_state, client_states, totals = ckpt["server_state"], ckpt["client_states"], ckpt["totals"]
            if start > cfg.rounds:
                raise ConfigError(f"rounds = {cfg.rounds} is fewer than the {start} rounds '{self.run_dir}' has "
                                  f"already run; resume it with rounds >= {start}.")
            history = self.files.history_before(start)
            used = ckpt.get("settings") or {}
            edited = {k: v for k, v in self._settings().items() if k in used and used[k] != v and k not in self.changes}
            if edited:  # config.yaml edited by hand since the checkpoint: a change like any other
                print(f"fedskew: config.yaml of '{self.run_dir}' was edited since its checkpoint ("
                      f"{', '.join(f'{k}: {used[k]!r} -> {v!r}' for k, v in edited.items())}); recorded as a change "
                      f"from round {start + 1}.", file=sys.stderr)
                self.changes = {**edited, **self.changes}
            if self.changes:  # settings changed at this resume, from round start + 1 (counted from 1)
                self.files.record_changes(start, self.changes)
        atomic_write_text("".join(json.dumps(h) + "\n" for h in history), self.run_dir / "metrics.jsonl")
        trackers = Trackers(cfg, self.run_dir, start)
        summary = None
        try:
            summary, global_state = self._rounds(start, history, global_state, server_state, client_states, totals,
                                                 trackers, on_round)
        finally:
            trackers.finish(summary)
        return self._result(summary, history, global_state)

    def _load_checkpoint(self, clients: bool = True) -> dict | None:
        return self.files.load_checkpoint({k: v.shape for k, v in federated_state(self.model).items()}, self.device,
                                          self.identity, clients)

    def _result(self, summary: dict, history: list[dict], global_state: dict) -> RunResult:
        """The result, with the final global state loaded into ``self.model`` (eval mode)."""
        names = set(self.model.state_dict())
        load_state(self.model, {k: v for k, v in global_state.items() if k in names})
        self.model.eval()
        return RunResult(self.run_dir, summary, history, global_state, self.cfg, self.model, self.environment)

    def finished_result(self) -> RunResult | None:
        """The finished run in the run directory, read back: its checkpoint, metrics and summary
        (nothing is written); None when its last checkpoint is unreadable (the one before it was
        read: resuming from it runs the last rounds again, exactly)."""
        ckpt = self._load_checkpoint(clients=False)
        if ckpt is None or ckpt["next_round"] != self.cfg.rounds:
            return None
        summary = read_json(self.run_dir / "summary.json", "run summary", own=True, model=RunSummary).model_dump()
        return self._result(summary, self.files.history_before(ckpt["next_round"]),
                            self.method.evaluation_state(ckpt["global_state"], ckpt["server_state"]))

    def _rounds(self, start, history, global_state, server_state, client_states, totals, trackers,
                 on_round) -> tuple[dict, dict]:
        """Rounds ``start`` .. the last (records appended to ``history``), then the summary; returns
        (summary, the final global model as its metrics scored it: ``Method.evaluation_state``)."""
        cfg = self.cfg
        for t in range(start, cfg.rounds):
            record = self._round(t, global_state, server_state, client_states, totals)
            global_state, server_state = record.pop("_global"), record.pop("_server")
            history.append(record)
            # the trackers first: a process killed between them and the checkpoint runs the round again
            # and the trackers take the replay idempotently (TensorBoard purges the steps after the
            # checkpoint, MLflow and an online W&B run skip the steps they hold); logged after the
            # checkpoint, a round killed in between would be missing from them for ever
            trackers.log(record)
            append_line(record, self.run_dir / "metrics.jsonl")
            stop = (STOP.is_set() if self.pack is None else self.pack.stopping) and t < cfg.rounds - 1
            if (t + 1) % cfg.checkpoint_every == 0 or t == cfg.rounds - 1 or stop:
                self._checkpoint({"next_round": t + 1, "global_state": global_state, "server_state": server_state,
                                  "client_states": client_states, "totals": totals})
            if stop:
                raise RunInterrupted(f"'{self.run_dir}' stopped after round {t + 1} of {cfg.rounds}, as asked, with "
                                     f"its checkpoint: `fedskew resume {self.run_dir}` continues it.")
            if on_round:
                on_round(record)

        summary = self._summary(history, global_state, server_state, client_states, totals)
        atomic_write_text(json.dumps(summary, indent=2), self.run_dir / "summary.json")
        return summary, self.method.evaluation_state(global_state, server_state)  # (the model the metrics scored)

    def _round(self, t, global_state, server_state, client_states, totals) -> dict:
        cfg, method = self.cfg, self.method
        t0 = time.perf_counter()
        train = self.training_clients
        selected = [train[i] for i in sample_clients(cfg.seed, t, len(train), cfg.clients_per_round)]
        lr = cfg.round_lr(t) * method.lr_scale(t)
        server_state = method.round_start(server_state, selected, t)
        t1 = time.perf_counter()
        # Persistent client states (HPMs, control variates, previous models) live in host memory
        # between rounds; only the selected clients' states visit the device.
        payload, on_device, downloads = dispatch(method, self.info, t, selected, global_state, server_state,
                                                 client_states, self.device)
        dropped = dropped_clients(cfg.seed, t, selected, cfg.client_dropout)  # (received the model, never answer)
        training = [k for k in selected if k not in dropped]
        results, failed = self._train(t, training, payload, on_device, lr, **self._downloads_for(downloads))
        train_s = time.perf_counter() - t1
        for r in results:
            if not math.isfinite(r.train_loss):
                raise FloatingPointError(f"round {t + 1}: client {r.client_id}'s local loss is {r.train_loss} "
                                         f"(training diverged); {self.files.divergence_advice()}")
            # each tensor in storage of its own (compact: a vectorised client's state is a slice of the
            # stacked one), as a resume reads it back: CPU kernels round by the data's alignment, so a
            # slice and its copy gave FedAH results 1e-8 apart after a resume
            client_states[r.client_id] = compact(to_device(r.client_state, torch.device("cpu")))
        uploads = [r.upload for r in results]
        reports = [r.report for r in results]
        new_global, new_server = method.aggregate(server_state, global_state, uploads, reports)
        if not all(torch.isfinite(v).all() for v in new_global.values() if v.is_floating_point()):
            raise FloatingPointError(f"round {t + 1}: the aggregated model holds NaN or inf (training diverged); "
                                     f"{self.files.divergence_advice()}")
        # fixed architecture tensors (the ETF head): counted once, in round 0, as if sent at setup
        fixed = (
            sum(v.numel() for k, v in self.model.state_dict().items() if k in self.model.fixed_keys) if t == 0 else 0
        )
        samples_seen = sum(r.report.num_samples * cfg.local_epochs for r in results)
        record = {
            "round": t,
            "clients": selected,
            "clients_failed": failed,
            "lr": lr,
            **self._system(t, training, dropped),
            **client_means(results),
            **communication(payload, downloads, uploads, len(selected), fixed, totals),
            "time/client_train_s": train_s,
            "time/samples_per_s": samples_seen / max(train_s, 1e-9),
        }
        evaluate = (t + 1) % cfg.eval_every == 0 or t == cfg.rounds - 1
        if evaluate and not method.has_global_model:
            record["global/test_acc"] = None  # no model serves the global test set (FedProto, FedRep)
        elif evaluate:
            scored = method.evaluation_state(new_global, new_server)
            record.update(global_metrics(self.model, scored, self.x_test, self.y_test, self.fed.num_classes))
            if self.fed.data.x_val is not None:
                x_val, y_val = self.fed.data.x_val.to(self.device), self.fed.data.y_val.to(self.device)
                record["global/val_acc"] = (predict(self.model, scored, x_val) == y_val).float().mean().item()
            if cfg.feature_stats:
                record.update(feature_stats(self.model, scored, self.x_test))
        record["memory/client_state_bytes"] = sum(v.numel() * v.element_size() for st in client_states.values()
                                                  for v in st.values())
        key = "model.classifier.weight"
        if cfg.classifier_stats and key in payload:
            record.update(proxy_record(payload[key], [(r.upload[key], self.info.class_counts[r.client_id] > 0)
                                                      for r in results if key in r.upload], lr))
        if cfg.forgetting_stats:
            m = cfg.forgetting_test_samples
            record.update(forgetting_record(self.model, model_part(payload),
                                            {r.client_id: model_part(r.upload) for r in results},
                                            self.info.class_counts, method.class_role_threshold(self.fed.num_classes),
                                            self.x_test[:m], self.y_test[:m],
                                            self.fed.num_classes))
        if self.executor.peak_state_bytes:
            record["memory/peak_state_bytes"] = self.executor.peak_state_bytes
        if self.executor.round_peak_bytes is not None:  # the device allocator's peak (CUDA)
            record["memory/peak_device_bytes"] = self.executor.round_peak_bytes
        record["time/round_s"] = time.perf_counter() - t0
        record["_global"], record["_server"] = new_global, new_server
        return record

    def _train(self, t, selected, payload, states, lr, **kw):
        """Train the selected clients; a client whose training raises is reported (``clients_failed``)
        and left out, unless ``fail_fast``. On a failure the round is retried client by client on
        the sequential executor, so the others' results are exactly what they would have been."""
        try:
            # an executor that loses clients itself (Flower: a node that does not answer) lists them
            # in ``failed`` and returns the others
            return self.executor.train_round(t, selected, payload, states, lr, **kw), list(self.executor.failed)
        except ClientFailure:
            raise
        except Exception:
            if self.cfg.fail_fast or self.executor.sequential is None:
                raise
        sequential = self.executor.sequential
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

    def _system(self, t: int, training: list[int], dropped: list[int]) -> dict:
        """The round's system heterogeneity, when asked for: the clients that dropped out and those
        that straggled (``streams.straggler_steps`` drew fewer steps than their budget)."""
        cfg, out = self.cfg, {}
        if cfg.client_dropout:
            out["clients_dropped"] = dropped
        if cfg.stragglers:
            budgets = {k: local_budget(local_settings(cfg), self.method, t, k, len(self.fed.train_idx[k]))
                       for k in training}
            out["clients_straggling"] = [k for k, (full, done) in budgets.items() if done < full]
        return out

    def _downloads_for(self, downloads: dict) -> dict:
        """Flower's executor (``remote_states``: client states on the nodes) takes the downloads apart."""
        return {"downloads": downloads} if self.executor.remote_states else {}

    @functools.cached_property
    def held_out(self) -> list[int]:
        """The clients that never train (``partition.held_out``: :func:`~fedskew.streams.held_out_clients`)."""
        return held_out_clients(self.cfg.seed, self.fed.num_clients, self.cfg.partition.held_out)

    @functools.cached_property
    def training_clients(self) -> list[int]:
        held = set(self.held_out)
        return [k for k in range(self.fed.num_clients) if k not in held]

    def _final_personalization(self, global_state, server_state, client_states) -> dict:
        """Every client receives the final global model and trains once, as the method personalises
        (its personal stage, or a local pass; no aggregation, no state kept):
        ``personal/final_acc_before`` and ``personal/final_acc_after`` over the clients that trained
        in the rounds, with a validation hold-out ``personal/final_val_acc_after`` (what selection
        reads for a method without a global model), and ``unseen/final_acc_before`` (the final
        global model) and ``unseen/final_acc_after`` (what the method gives a new client) over the
        held-out clients."""
        cfg = self.cfg
        clients = list(range(self.fed.num_clients))
        # (a copy: the states of clients never selected are made for this pass and not kept)
        payload, states, downloads = dispatch(self.method, self.info, cfg.rounds, clients, global_state, server_state,
                                              dict(client_states), self.device)
        validate = self.fed.data.x_val is not None and self.executor.validates
        self.executor.score_validation = validate
        try:
            results = self.executor.train_round(cfg.rounds, clients, payload, states,
                                                cfg.round_lr(cfg.rounds) * self.method.lr_scale(cfg.rounds),
                                                **self._downloads_for(downloads))
        finally:
            self.executor.score_validation = False
        held = set(self.held_out)
        out = {}
        for prefix, part in (("personal", [r for r in results if r.client_id not in held]),
                             ("unseen", [r for r in results if r.client_id in held])):
            if not part:
                continue
            before, before_std = mean_std([r.acc_before for r in part])
            after, after_std = mean_std([r.acc_after for r in part])
            out.update({f"{prefix}/final_acc_before": before, f"{prefix}/final_acc_before_std": before_std,
                        f"{prefix}/final_acc_after": after, f"{prefix}/final_acc_after_std": after_std,
                        # per client, in client order (the fairness histogram of MAP Figure 10)
                        f"{prefix}/final_acc_before_per_client": [r.acc_before for r in part],
                        f"{prefix}/final_acc_after_per_client": [r.acc_after for r in part]})
            if validate and prefix == "personal":
                out["personal/final_val_acc_after"] = mean_std([r.val_after for r in part])[0]
        if held:
            out["unseen/clients"] = sorted(held)
        return out

    def _summary(self, history, global_state, server_state, client_states, totals) -> dict:
        c = self.cfg
        summary = {"method": c.method.name, "dataset": c.dataset.name, "partition": c.partition.name,
                   "model": c.model.name, "seed": c.seed, "rounds": c.rounds, **run_summary(history, totals)}
        if c.final_personalization and c.partition.local_test_fraction > 0:
            summary.update(self._final_personalization(global_state, server_state, client_states))
        return summary


def local_settings(cfg) -> LocalSettings:
    """How the clients of a run (``cfg`` a RunConfig) train locally. ``channels_last``'s ``auto`` is
    off, as ``compile``'s is: the layout awaits a GPU measurement of FedMR's ResNet-18 round
    (benchmarks/engine_speed.py's ``sequential-cl`` engine)."""
    return LocalSettings(cfg.local_epochs, cfg.batch_size, cfg.momentum, cfg.weight_decay, cfg.grad_clip, cfg.seed,
                         4 if cfg.dataset.augment else 0, cfg.precision, cfg.optimizer, tuple(cfg.adam_betas),
                         cfg.adam_eps, cfg.stragglers, cfg.rounds, compile_step(cfg), cfg.channels_last == "on")


def compile_step(cfg) -> bool:
    """Whether the vectorised step runs through torch.compile: ``compile = on``; ``auto`` is off
    everywhere until a measurement shows that it pays (on this project's CPU a warm compiled lite
    run took 1.16 x the eager one's time, after a compile of about 90 s: benchmarks/compile_speed.py;
    on CUDA it is not measured yet)."""
    return cfg.compile == "on"


def executor_name(cfg, model, method, device) -> str:
    """The executor a run trains on: ``executor`` as given, or for ``auto`` the vectorised one
    (faster on the CPU and GPU where it runs: benchmarks/engine_speed.py, benchmarks/round_cost.py)
    unless the run asks for the sequential executor's layout (``channels_last = on``), a round has
    one client (nothing to stack), the method does not vectorise, or the CPU trains its convolutions
    faster one client after another (:func:`~fedskew.engine.vectorized.cpu_convolutions_alone`). A
    rule of the configuration: a run's executor never depends on a timing."""
    if cfg.executor != "auto":
        return cfg.executor
    if cfg.compile == "on":
        return "vectorized"
    if cfg.channels_last == "on" or cfg.clients_per_round == 1 or not method.vectorizable or \
            cpu_convolutions_alone(model, device, cfg.batch_size):
        return "sequential"
    return "vectorized"


def make_executor(cfg, model, fed, method, device, pack=None):
    """The run's executor (``cfg`` a RunConfig; :func:`executor_name`); with ``pack`` (a
    :class:`~fedskew.engine.lanes.Pack`) the vectorised one whose stages train as lanes of the pack's
    stacked program."""
    settings = local_settings(cfg)
    if pack is not None:
        return LaneExecutor(model, fed, method, settings, device, cfg.max_parallel_clients, cfg.pad_batches, pack=pack)
    if executor_name(cfg, model, method, device) == "vectorized":
        return VectorizedExecutor(model, fed, method, settings, device, cfg.max_parallel_clients, cfg.pad_batches)
    return SequentialExecutor(model, fed, method, settings, device)


class ClientFailure(RuntimeError):
    """Every selected client of a round failed."""


def run(cfg: RunConfig, run_dir: Path | None = None, on_round=None) -> RunResult:
    return Experiment(cfg, run_dir).run(on_round)
