"""A run directory and what a run leaves in it (design.md, "Run directory and resume").

``config.yaml`` (resolved, with seed, library version and the environment), ``partition.json`` and
``partition.png``, ``metrics.jsonl`` (one JSON object per round), ``summary.json`` and
``checkpoint.pt`` (every ``checkpoint_every`` rounds, written atomically; the one before is kept as
``checkpoint.prev.pt`` when it reads back). A checkpoint's client states lie in ``clients/``, one
file per client and version (``<client>-<round>.pt``), written only for the clients whose state
changed since the checkpoint before (a round of MAP's setting trains 10 of 100 clients: a tenth of
the bytes); ``checkpoint.pt`` names the file of every client with its SHA-256 (a file that does
not hold those bytes, another run's, client's or round's or a damaged one, is not read: the
checkpoint before is used), and files neither checkpoint names are removed. A tensor is written
with its own bytes only (:func:`compact`: a client's slice of the vectorised executor's stacked
state would otherwise carry every client's). ``run.json`` holds the run's identity (what lets
``fedskew resume`` act on the folder). Checkpoints are plain tensors and containers, loaded with
``torch.load(weights_only=True)`` (nothing is unpickled); :func:`read_checkpoint` reads one whole.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from pydantic import BaseModel, ConfigDict

from fedskew import __version__
from fedskew.config import ADDED_RUN_KEYS, ConfigError, RunConfig, former_architecture_keys, without_added
from fedskew.engine.durable import (
    atomic_save,
    atomic_write,
    atomic_write_text,
    fsync_folder,
    read_records,
    replaceable,
    save_png,
)

STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EIO}


class StorageError(ConfigError):
    """The run directory cannot be written (full disk, permissions); one sentence, resumable."""


def default_run_dir(cfg: RunConfig) -> Path:
    """``out_dir/run_name``, or without a name ``out_dir/<method>-<dataset>-<partition>-s<seed>-<time>``,
    ``-2``, ``-3``, ... added when a run of the same second is there (runs of a second or less)."""
    if cfg.run_name:
        return Path(cfg.out_dir) / cfg.run_name
    base = (f"{cfg.method.name}-{cfg.dataset.name}-{cfg.partition.name}-s{cfg.seed}-"
            f"{time.strftime('%Y%m%d-%H%M%S')}")
    path, n = Path(cfg.out_dir) / base, 1
    while path.exists():
        n += 1
        path = Path(cfg.out_dir) / f"{base}-{n}"
    return path


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what ``platform`` says)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def environment(device: torch.device) -> dict:
    """What a result depends on beyond its config: library versions, the torch thread count (CPU
    kernels sum in another order with another count: the last digits move), the device and, in a
    git checkout of fedskew, the commit (``+dirty`` with uncommitted changes; ``FEDSKEW_GIT_COMMIT``
    stands for it where the code is a copy without its .git, as on a GPU machine the code was copied to)."""
    import platform

    env = {"fedskew": __version__, "python": platform.python_version(), "torch": str(torch.__version__),
           "numpy": str(np.__version__), "torch_threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    env["cpu"] = cpu_model()
    # a copy of the checkout without its .git names its commit so (a GPU window); where git can
    # answer, git's answer stands (an edited checkout is +dirty whatever the variable says)
    commit = git_commit() or os.environ.get("FEDSKEW_GIT_COMMIT")
    if commit:
        env["git_commit"] = commit
    return env


def git_commit() -> str | None:
    """In a git checkout of fedskew, its commit (12 digits), ``+dirty`` with uncommitted changes to
    tracked files; None elsewhere (an installed wheel, a copy without .git)."""
    import subprocess

    source = Path(__file__).resolve().parents[3]
    if not (source / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "-C", str(source), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "") if commit else None


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


MAX_CHECKPOINT = 4 << 30  # a checkpoint or client file of a run whose model is not known yet
MIN_CHECKPOINT = 64 << 20  # what any run's checkpoint may take beyond its model's copies


def checkpoint_limit(shapes: dict) -> int:
    """The most bytes a checkpoint of a model of ``shapes`` holds: 64 copies of the model in float64
    (server states such as control variates, momenta and the inline client states of old
    checkpoints are a few copies each) and 64 MB besides; a larger file is not this run's and is not read."""
    params = sum(int(np.prod(s)) for s in shapes.values())
    return MIN_CHECKPOINT + 64 * 8 * params


def _check_inflated_size(fh) -> None:
    """Refuse a checkpoint whose zip entries inflate past the file's own size: ``torch.save`` stores
    entries uncompressed, so only a foreign (or malicious) file compresses, and a 1 MB deflated
    entry could ask for gigabytes before ``torch.load`` checks anything."""
    try:
        with zipfile.ZipFile(fh) as archive:
            inflated = sum(info.file_size for info in archive.infolist())
    except (zipfile.BadZipFile, OSError) as exc:
        raise ValueError(f"it is not a zip archive as torch.save writes ({exc})") from None
    size = fh.seek(0, os.SEEK_END)
    fh.seek(0)
    if inflated > size:
        raise ValueError(f"its zip entries inflate to {inflated:,} bytes from a {size:,}-byte file (torch.save never "
                         f"compresses)")


# Settings a run may change when resumed (`fedskew resume DIR lr=0.005`): how it is optimised from now
# on, evaluated and recorded; not what it is (data, partition, model, method, seed).
RESUMABLE = ("lr", "lr_decay", "lr_decay_every", "lr_schedule", "lr_min", "grad_clip", "rounds", "eval_every",
             "checkpoint_every", "fail_fast", "logger",
             "final_personalization", "device", "executor", "distributed", "max_parallel_clients", "pad_batches",
             "compile", "channels_last", "precision", "feature_stats", "classifier_stats", "forgetting_stats",
             "forgetting_test_samples")


def run_identity(cfg: RunConfig) -> str:
    """What a run is (its config but the :data:`RESUMABLE` settings), as a hash a checkpoint
    carries: a checkpoint of another run (another method, data or model) is never taken."""
    what = {k: v for k, v in without_added(cfg.model_dump(mode="json"), ADDED_RUN_KEYS).items()
            if k not in RESUMABLE and k not in ("out_dir", "run_name", "logger_group")}
    what["model"] = {**former_architecture_keys(what["method"]), **what["model"]}  # keys that left the schema
    if isinstance(what.get("dataset"), dict):  # where the data set's files lie is not what the run is
        what["dataset"] = {k: v for k, v in what["dataset"].items() if k not in ("root", "download")}
    return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


class ClientStates(dict):
    """Every client's persistent state (client id -> tensors), and the clients whose state was set
    since the last checkpoint (``changed``): the checkpoint writes only theirs. States are replaced,
    never edited in place (the engine stores each client's new state as a new dict)."""

    def __init__(self, states=(), changed: bool = True):
        super().__init__(states)
        self.changed = set(self) if changed else set()

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.changed.add(key)

    def update(self, *args, **kw) -> None:
        for k, v in dict(*args, **kw).items():
            self[k] = v

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]


def _torch_load(path: Path, device, limit: int = MAX_CHECKPOINT) -> object:
    """A checkpoint through the file boundary: a regular file (never a link, a FIFO or a device) of at
    most ``limit`` bytes, its zip entries not inflating past it, read with ``weights_only``."""
    from fedskew.files import FileProblem, open_file

    try:
        fh = open_file(path, "checkpoint", own=True, limit=limit)
    except FileProblem as exc:
        raise ValueError(exc.reason) from None
    with fh:
        _check_inflated_size(fh)
        return torch.load(fh, map_location=device, weights_only=True)


def compact(obj):
    """``obj`` with every tensor that views a larger storage copied out: ``torch.save`` writes a
    tensor's whole storage, so one client's slice of a stacked (vectorised) state would otherwise
    carry every client's bytes into its file."""
    if isinstance(obj, torch.Tensor):
        own = obj.numel() * obj.element_size()
        return obj.clone(memory_format=torch.contiguous_format) if obj.untyped_storage().nbytes() > own else obj
    if isinstance(obj, dict):
        return {k: compact(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(compact(v) for v in obj)
    return obj


def _client_file(cid, version: int) -> str:
    return f"{cid}-{version}.pt"


def _read_head(path: Path, device, limit: int = MAX_CHECKPOINT) -> dict:
    ckpt = _torch_load(path, device, limit)
    if not isinstance(ckpt, dict) or "next_round" not in ckpt:
        raise ValueError("it is not a fedskew checkpoint")
    return ckpt


def _save_client(state: dict, path: Path) -> str:
    """Write one client file (durably, its folder fsynced by the caller); its SHA-256, which the
    checkpoint that names the file records (``client_digests``)."""
    import io

    buffer = io.BytesIO()
    torch.save(compact(state), buffer)
    data = buffer.getvalue()
    if path.is_dir() and not path.is_symlink():  # a folder put where a client file goes (fault probe)
        shutil.rmtree(path)
    atomic_write(lambda fh: fh.write(data), path, sync_folder=False)
    return hashlib.sha256(data).hexdigest()


def _read_clients(ckpt: dict, folder: Path, device, limit: int = MAX_CHECKPOINT) -> None:
    """``ckpt["client_states"]`` with the states of the client files ``ckpt["client_files"]`` names
    (a checkpoint written before client files holds every state inline). Each file's bytes must have
    the SHA-256 the checkpoint recorded for it (``client_digests``): another run's file,
    another client's, another round's or a damaged one is "cannot be read", so the caller falls
    back to the checkpoint before. (Checkpoints of fedskew before 2026-11-27 record no digests.)"""
    import io

    if "client_files" not in ckpt:
        return
    from fedskew.files import FileProblem, read_bytes

    states = dict(ckpt.get("client_states", {}))  # (empty ones are held inline)
    digests = ckpt.get("client_digests")
    for cid, version in ckpt["client_files"].items():
        file = folder / _client_file(cid, version)
        try:
            data = read_bytes(file, "client file", own=True, limit=limit)
        except FileProblem:
            raise ValueError(f"clients/{file.name}, which it names, is missing or not a file") from None
        if digests is not None and hashlib.sha256(data).hexdigest() != digests.get(cid):
            raise ValueError(f"clients/{file.name}, which it names, does not hold what it recorded (another "
                             f"run's, client's or round's file, or a damaged one)")
        try:
            _check_inflated_size(io.BytesIO(data))
            states[cid] = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
        except Exception as exc:
            raise ValueError(f"clients/{file.name}, which it names, cannot be read "
                             f"({(str(exc).splitlines() or [''])[0][:80] or type(exc).__name__})") from None
    ckpt["client_states"] = ClientStates(states, changed=False)


def read_checkpoint(path: Path | str, device: torch.device | str = "cpu") -> dict:
    """A checkpoint file (``checkpoint.pt`` or ``checkpoint.prev.pt``) read whole: ``next_round``,
    ``global_state``, ``server_state``, ``totals``, ``run`` and ``client_states`` (client id ->
    tensors, read from the ``clients/`` files the checkpoint names in ``client_files``)."""
    ckpt = _read_head(Path(path), device)
    _read_clients(ckpt, Path(path).parent / "clients", device)
    return ckpt


class RunRecord(BaseModel):
    """``run.json``: the run's identity, who wrote it, the token its checkpoints carry and, for a method
    of the user's, the file it came from (said to the user, never imported)."""

    model_config = ConfigDict(extra="ignore")
    run: str
    written_by: str | None = None
    token: str | None = None
    method_source: dict[str, str] | None = None


class RunSummary(BaseModel):
    """``summary.json`` as a finished run's result is read back: what the run was and its metrics."""

    model_config = ConfigDict(extra="allow")
    method: str
    dataset: str
    partition: str
    seed: int
    rounds: int


_HEATMAPS: dict[str, bytes] = {}  # partition heatmaps drawn in this process (RunDir.write_partition)


class RunDir:
    """The files of one run directory, written by the process that holds its lock."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.current_ok = False  # checkpoint.pt is known to read back
        self.checkpoint_round = 0  # the rounds the newest checkpoint holds
        self.client_files: dict | None = None  # client -> version of its file, as the newest checkpoint names them
        self.client_digests: dict = {}  # client -> SHA-256 of that file

    def write_record(self, cfg: RunConfig, env: dict, resumed: bool) -> None:
        """``config.yaml``: the resolved config and the environment; a resumed run keeps where its
        earlier parts ran (``environment_previous``) and its earlier ``changes``."""
        record = {**cfg.resolved(), "environment": env}
        old = self.path / "config.yaml"
        if resumed and old.is_file():
            from fedskew.files import read_yaml

            before = read_yaml(old, "run config record", own=True)
            before = before if isinstance(before, dict) else {}
            previous = before.get("environment_previous", [])
            if before.get("environment") not in (None, env):
                previous = [*previous, before["environment"]]
            if previous:
                record["environment_previous"] = previous
            if before.get("changes"):
                record["changes"] = before["changes"]
        atomic_write_text(yaml.safe_dump(record, sort_keys=False), old)

    def write_identity(self, identity: str, method_source: dict | None = None) -> None:
        """``run.json``: the run's identity (:func:`run_identity`), written when the run starts in
        this folder (or first resumes here), so that ``fedskew resume`` acts only on a folder a run of
        fedskew wrote; a copied config.yaml alone does not make a folder a run. For a
        method of the user's, where its module is (``method_source``: module, file, SHA-256), so that a
        resume without ``--import`` can say what to pass (it never imports it itself)."""
        path = self.path / "run.json"
        if os.path.lexists(path) and (path.is_symlink() or not path.is_file()):
            raise ConfigError(f"'{path}' is not a file (a folder or a link stands where the run's record goes); "
                              f"this folder is not resumed and nothing in it is touched.")
        if not path.is_file():
            # token: a random name of this run, carried by every checkpoint it writes, so that a run.json
            # and a config.yaml copied beside other files do not make a folder this run's
            record = {"run": identity, "written_by": "fedskew", "token": secrets.token_hex(8)}
            if method_source:
                record["method_source"] = method_source
            atomic_write_text(json.dumps(record), path)

    def record(self) -> dict:
        """``run.json``'s record ({} when absent or not of :class:`RunRecord`'s shape: not fedskew's)."""
        from fedskew.files import FileProblem, read_json

        try:
            record = read_json(self.path / "run.json", "run record", own=True, limit=1 << 20, model=RunRecord)
        except FileProblem:
            return {}
        return record.model_dump(exclude_none=True)

    def proves(self, identity: str) -> bool:
        """Whether this folder holds a run of ``identity`` that fedskew wrote: a checkpoint of it that
        reads back as fedskew's and names ``identity`` and the token of the folder's ``run.json``
        (a run from before tokens: no token on either side). A ``run.json`` and a ``config.yaml``
        copied beside other files prove nothing: resuming there would replace those files."""
        record = self.record()
        if record and record.get("run") != identity:
            return False
        for name in ("checkpoint.pt", "checkpoint.prev.pt"):
            path = self.path / name
            if path.is_symlink() or not path.is_file():
                continue
            try:
                head = _read_head(path, "cpu")
            except Exception:  # damaged or not fedskew's: no proof
                continue
            if head.get("run") == identity and head.get("token") == record.get("token"):
                return True
        return False

    def unreadable(self, identity: str) -> list[str]:
        """Why each checkpoint of a folder whose ``run.json`` names ``identity`` does not prove the
        run (damaged, another run's), one reason a file; [] when run.json names another run or no
        checkpoint file is there (then the folder is not shown to be this run's at all)."""
        record = self.record()
        if record.get("run") != identity:
            return []
        reasons = []
        for name in ("checkpoint.pt", "checkpoint.prev.pt"):
            path = self.path / name
            if not os.path.lexists(path):
                continue
            try:
                head = _read_head(path, "cpu")
                reason = ("it belongs to another run (another method, data, partition or model)"
                          if head.get("run") != identity else "it was written by another run of this config")
            except Exception as exc:
                reason = (str(exc).splitlines() or [""])[0][:120] or type(exc).__name__
            reasons.append(f"{name}: {reason}")
        return reasons

    def write_partition(self, fed, title: str) -> None:
        """``partition.json`` and the heatmap ``partition.png``, drawn once per process for each
        partition (the runs of a sweep that share a partition and a title share the picture)."""
        rows = fed.summary_rows()
        (self.path / "partition.json").write_text(json.dumps(rows))
        key = hashlib.sha1(json.dumps([title, fed.counts("train").tolist()]).encode()).hexdigest()
        if key not in _HEATMAPS:
            if len(_HEATMAPS) >= 16:
                _HEATMAPS.pop(next(iter(_HEATMAPS)))
            save_png(fed.heatmap(title), self.path / "partition.png", dpi=110)
            _HEATMAPS[key] = (self.path / "partition.png").read_bytes()
        else:
            atomic_write(lambda fh: fh.write(_HEATMAPS[key]), self.path / "partition.png")

    def record_changes(self, start: int, changes: dict) -> None:
        """Settings changed at a resume, in config.yaml's ``changes``, from round ``start + 1``."""
        from fedskew.files import read_yaml

        path = self.path / "config.yaml"
        record = read_yaml(path, "run config record", own=True)
        record["changes"] = [*record.get("changes", []), {"from_round": start + 1, **changes}]
        atomic_write_text(yaml.safe_dump(record, sort_keys=False), path)

    def checkpoint(self, state: dict) -> None:
        """Write ``checkpoint.pt`` (atomic, fsynced) after the client files it names; the one before
        becomes ``checkpoint.prev.pt``, but only when it is known to read back: a corrupt one is
        dropped, never rotated over the good backup. Client files that neither names are removed."""
        states, before = state["client_states"], self.client_files or {}
        changed = states.changed if isinstance(states, ClientStates) else set(states)
        inline = {k: st for k, st in states.items() if not st}  # (stateless methods' empty states)
        files = {k: before[k] for k in states if k in before and k not in changed and k not in inline
                 and k in self.client_digests}
        digests = {k: self.client_digests[k] for k in files}
        folder = self.path / "clients"
        if len(files) + len(inline) < len(states):
            folder.mkdir(exist_ok=True)
            for k in states:
                if k not in files and k not in inline:
                    digests[k] = _save_client(states[k], folder / _client_file(k, state["next_round"]))
                    files[k] = state["next_round"]
            fsync_folder(folder)  # every client file is on disk before the checkpoint that names it
        state = {**state, "client_states": inline, "client_files": files, "client_digests": digests}
        path = self.path / "checkpoint.pt"
        replaceable(path, self.path / "checkpoint.prev.pt")
        if path.exists():
            if self.current_ok:
                os.replace(path, self.path / "checkpoint.prev.pt")
            else:
                path.unlink()
        atomic_save(compact(state), path)
        self.current_ok = True
        self.checkpoint_round = state["next_round"]
        self.client_files, self.client_digests = files, digests
        if isinstance(states, ClientStates):
            states.changed.clear()
        # checkpoint.prev.pt is the checkpoint that was newest before (written or resumed from) or none
        keep = {_client_file(k, v) for index in (files, before) for k, v in index.items()}
        for old in folder.glob("*.pt*") if folder.is_dir() else ():
            if old.name not in keep:
                if old.is_dir() and not old.is_symlink():
                    shutil.rmtree(old)
                else:
                    old.unlink(missing_ok=True)

    def divergence_advice(self) -> str:
        """What can be done after a divergence, given what is on disk."""
        if self.checkpoint_round:
            return (f"the checkpoint after round {self.checkpoint_round} is kept: `fedskew resume {self.path} "
                    f"lr=<smaller>` (or grad_clip=<norm>) continues from it.")
        return "no round's checkpoint was written yet: start again with a smaller lr or with grad_clip set."

    def load_checkpoint(self, shapes: dict, device: torch.device, identity: str | None = None,
                        clients: bool = True) -> dict | None:
        """The newest readable checkpoint whose global state has ``shapes`` (and, when it records
        one, whose run ``identity`` is this run's: :func:`run_identity`), with its client files:
        ``checkpoint.pt``, else (truncated, corrupt, a client file missing, or another run's, with a
        notice) ``checkpoint.prev.pt``; None when the run never wrote one. ``clients=False``: the client
        states are not read (a finished run's result needs the global state only)."""
        paths = [p for p in (self.path / "checkpoint.pt", self.path / "checkpoint.prev.pt") if os.path.lexists(p)]
        errors = []
        limit = checkpoint_limit(shapes)
        for path in paths:
            try:
                ckpt = _read_head(path, device, limit)
                if not isinstance(ckpt["next_round"], int) or ckpt["next_round"] < 0:
                    raise ValueError(f"its next_round is {ckpt['next_round']!r}, not a round count")
                if any(shapes.get(k) != v.shape for k, v in ckpt["global_state"].items()):
                    raise ValueError("it holds another model's tensors")
                if identity is not None and ckpt.get("run", identity) != identity:
                    raise ValueError("it belongs to another run (another method, data, partition or model)")
                if clients:
                    _read_clients(ckpt, self.path / "clients", device, limit)
            except Exception as exc:  # empty, truncated, corrupt or foreign file: try the previous one
                reason = (str(exc).splitlines() or [""])[0][:120] or type(exc).__name__
                errors.append(f"{path.name}: {reason}")
                print(f"fedskew: cannot read {path} ({reason}); trying the previous checkpoint.", flush=True)
                continue
            self.current_ok = path.name == "checkpoint.pt"
            self.checkpoint_round = ckpt["next_round"]
            self.client_files = ckpt.get("client_files")
            self.client_digests = dict(ckpt.get("client_digests") or {})
            if clients and not isinstance(ckpt["client_states"], ClientStates):  # held inline: all written anew
                ckpt["client_states"] = ClientStates(ckpt["client_states"])
            return ckpt
        if errors:
            raise ConfigError(f"no readable checkpoint in '{self.path}' ({'; '.join(errors)}); remove the "
                              f"directory (or choose another run_name) and start the run again.")
        return None

    def history_before(self, start: int) -> list[dict]:
        """Rounds 0 .. start-1 of ``metrics.jsonl``, each exactly once (a torn last line dropped);
        anything else means two processes wrote the directory or the file was edited."""
        history = [h for h in read_records(self.path / "metrics.jsonl") if h["round"] < start]
        rounds = [h["round"] for h in history]
        if rounds != list(range(start)):
            missing = sorted(set(range(start)) - set(rounds))
            twice = sorted({r for r in rounds if rounds.count(r) > 1})
            raise ConfigError(f"cannot resume '{self.path}': its checkpoint is after round {start} but "
                              f"metrics.jsonl "
                              f"{'lacks rounds ' + str([r + 1 for r in missing[:10]]) if missing else ''}"
                              f"{' and ' if missing and twice else ''}"
                              f"{'holds rounds ' + str([r + 1 for r in twice[:10]]) + ' twice' if twice else ''} "
                              f"(two processes wrote it, or it was edited); start the run again in a new directory.")
        return history


__all__ = ["RESUMABLE", "ClientStates", "RunDir", "RunResult", "STORAGE_ERRNOS", "StorageError", "default_run_dir",
           "environment", "read_checkpoint", "run_identity"]
