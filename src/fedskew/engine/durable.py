"""Files that survive crashes and are never shared: exclusive folder locks, atomic and fsynced
writes, and a metrics log whose torn last line is detected.

- :class:`FolderLock`: an OS lock (``fcntl.flock``) on ``FOLDER/.fedskew.lock``, held for the life of
  the process that took it: a second writer is refused with one sentence naming the holder's PID,
  and a crashed or killed holder releases it with its file descriptors (no stale lock files).
- :func:`atomic_write_text` / :func:`atomic_save`: write a temporary file, fsync it, rename it
  over the target, fsync the folder: after a crash the target is the old or the new content,
  never a prefix.
- :func:`append_line`: one JSON record per line, flushed and fsynced; :func:`read_records`
  drops a torn last line (a crash or a full disk mid-append) and refuses corruption elsewhere.
- :data:`STOP`: set by :func:`stop_after_this_round` (a sweep worker's SIGTERM/SIGINT handler) and by the
  command line's handlers (beside their KeyboardInterrupt, which Python may drop), it makes the run loop
  checkpoint after the round it is in and raise :class:`RunInterrupted`.
- :func:`signals_held`: SIGINT and SIGTERM held back during a few writes that must not be split.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import threading
from pathlib import Path

from fedskew.config import ConfigError

LOCK_NAME = ".fedskew.lock"


class StopFlag:
    """A flag a signal handler may set: no lock. ``threading.Event.set`` takes a lock, and a second
    signal (the sweep's SIGTERM after a terminal's SIGINT) whose handler ran while the first
    handler held it deadlocked the worker for good (reproduced: a handler preempted inside
    ``Event.set``); a plain attribute store is atomic under the GIL."""

    def __init__(self):
        self._set = False

    def set(self) -> None:
        self._set = True

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set


STOP = StopFlag()


class RunInterrupted(RuntimeError):
    """A run stopped at a round boundary, with a checkpoint, because :data:`STOP` was set."""


def stop_after_this_round(signum=None, frame=None) -> None:
    STOP.set()


@contextlib.contextmanager
def signals_held():
    """``with signals_held():`` a SIGINT or SIGTERM that arrives in the block is handled when the block
    ends, by the handler that was in place (a KeyboardInterrupt then, from the block's last line): for
    the writes that make a folder a run's, through its first checkpoint, which a Ctrl-C must not split
    (a folder with the run's record and no checkpoint could not show a resume that it is the run's).
    Signals reach Python's main thread only: elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list = []
    kinds = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.signal(s, lambda signum, frame: held.append((signum, frame))) for s in kinds}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if held:  # the first one, as it would have been handled
            signum, frame = held[0]
            handler = before[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler in (signal.SIG_DFL, None):
                os.kill(os.getpid(), signum)  # (the default action: SIGINT's is Python's own handler, callable)


class FolderLock:
    """``with FolderLock(folder, what):`` the folder is this process's until the block ends."""

    def __init__(self, folder: Path, what: str):
        self.path = Path(folder) / LOCK_NAME
        self.what = what
        self.fd: int | None = None

    def acquire(self) -> FolderLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            self.fd = None
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"{self.what} '{self.path.parent}' is in use by another fedskew process (pid "
                                  f"{holder}); wait for it to finish or stop it, or choose another folder.") from None
            raise
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def blocking_file(folder: Path) -> Path | None:
    """The file (if any) standing where ``folder`` or one of its parents must be a folder."""
    return next((d for d in (folder, *folder.parents) if d.exists() and not d.is_dir()), None)


def fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(write, path: Path, sync_folder: bool = True) -> None:
    """``write(fh)`` into a temporary file, fsync it, rename it over ``path``, fsync the folder
    (``sync_folder=False``: the caller fsyncs it once after several files)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException as exc:  # (a full disk: give back what the half-written file took)
        tmp.unlink(missing_ok=True)
        if not isinstance(exc, (OSError, KeyboardInterrupt)):
            # torch.save's zip writer turns the disk's OSError (ENOSPC), or a Ctrl-C / SIGTERM that
            # arrived inside it, into a RuntimeError on its way out ("unexpected pos"): the storage
            # error or the interruption is what callers answer in one sentence
            cause = exc.__context__
            while cause is not None and not isinstance(cause, (OSError, KeyboardInterrupt)):
                cause = cause.__context__
            if cause is not None:
                raise cause from exc
        raise
    os.replace(tmp, path)
    if sync_folder:
        fsync_folder(path.parent)


def save_png(fig, path: Path, dpi: int = 100) -> Path:
    """A matplotlib figure as a PNG that is complete or absent (never a 0-byte or cut-off image);
    the figure is closed."""
    import matplotlib.pyplot as plt

    try:
        atomic_write(lambda fh: fig.savefig(fh, format="png", dpi=dpi), Path(path))
    finally:
        plt.close(fig)
    return Path(path)


def atomic_write_text(text: str, path: Path) -> None:
    atomic_write(lambda fh: fh.write(text.encode()), path)


def atomic_save(obj, path: Path, sync_folder: bool = True) -> None:
    """``torch.save`` made durable: the file at ``path`` is complete or absent (streamed to disk, so
    a large checkpoint is never held twice in memory)."""
    import torch

    atomic_write(lambda fh: torch.save(obj, fh), path, sync_folder)


def append_line(record: dict, path: Path) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_records(path: Path) -> list[dict]:
    """The records of a metrics log. A last line without its newline, or the last line not valid
    JSON, is the trace of an interrupted append and is dropped; a bad line before it is
    corruption (one sentence)."""
    text = path.read_text(errors="replace") if path.is_file() else ""
    *complete, torn = text.split("\n")  # torn: what follows the last newline ("" after a clean append)
    records = []
    for i, line in enumerate(complete):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or "round" not in rec:
                raise ValueError("not a round record")
        except ValueError:
            if i == len(complete) - 1 and not torn:
                break
            raise ConfigError(f"'{path}' line {i + 1} is not a round record (the file was edited or corrupted); "
                              f"start the run again in a new run directory.") from None
        records.append(rec)
    return records


__all__ = ["FolderLock", "append_line", "blocking_file", "atomic_save", "atomic_write_text", "fsync_folder",
           "read_records"]
