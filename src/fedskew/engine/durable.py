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
import stat
import threading
from pathlib import Path

from fedskew.config import ConfigError

LOCK_NAME = ".fedskew.lock"
MAX_LOG = 1 << 30  # metrics.jsonl: a few KB a round


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
        # never through a link: a lock file that is a symbolic link, a hard link to another file, or
        # anything but a regular file was put there by someone else, and writing the PID would change it
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise
            raise ConfigError(f"'{self.path}' is not a lock file of fedskew's (a link, a folder or a device stands "
                              f"there), so {self.what} '{self.path.parent}' is not touched; remove it, or choose "
                              f"another folder.") from None
        info = os.fstat(self.fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(self.fd)
            self.fd = None
            kind = "a hard link to another file" if stat.S_ISREG(info.st_mode) else "a FIFO, a device or a socket"
            raise ConfigError(f"'{self.path}' is not a lock file of fedskew's ({kind}), so {self.what} "
                              f"'{self.path.parent}' is not touched; remove it, or choose another folder.")
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

    def check_free(self) -> None:
        """One sentence when another process holds the lock now; reads and writes nothing (a folder
        that is not fedskew's may be probed before anything is written into it)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return  # no lock file, or none of fedskew's: acquire() says which
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                raise ConfigError(f"{self.what} '{self.path.parent}' is in use by another fedskew process (pid "
                                  f"{holder}); wait for it to finish or stop it, or choose another folder.") from None
        finally:
            os.close(fd)

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


def replaceable(path: Path, *more: Path) -> None:
    """One sentence where a folder, a FIFO or a device stands where fedskew replaces a file of its own
    (a link is replaced itself, never written through)."""
    for where in (Path(path), *map(Path, more)):
        if os.path.lexists(where) and not where.is_symlink() and not stat.S_ISREG(os.lstat(where).st_mode):
            raise ConfigError(f"'{where}' is not a file (a folder or a special file stands where fedskew writes "
                              f"'{Path(path).name}'), so nothing was replaced; move it away and run the command "
                              f"again.")


def atomic_write(write, path: Path, sync_folder: bool = True) -> None:
    """``write(fh)`` into a temporary file, fsync it, rename it over ``path``, fsync the folder
    (``sync_folder=False``: the caller fsyncs it once after several files)."""
    tmp = path.with_name(path.name + ".tmp")
    replaceable(path, tmp)
    if os.path.lexists(tmp):  # a crash's leftover, or a link planted there: removed, never written through
        tmp.unlink()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as fh:
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


def replace_folder(source: Path, target: Path) -> None:
    """``target`` made a copy of the folder ``source``, or left as it was: the copy is made beside it on
    the same file system and renamed into place, so a full disk or a crash mid-copy leaves the old
    folder whole (and the partial copy removed)."""
    import shutil

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    new = target.with_name(f".{target.name}.new-{os.getpid()}")
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    shutil.rmtree(new, ignore_errors=True)
    try:
        shutil.copytree(source, new, symlinks=True, copy_function=shutil.copy2)
        fsync_folder(new)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    if os.path.lexists(target):
        os.replace(target, old)
    os.replace(new, target)
    fsync_folder(target.parent)
    shutil.rmtree(old, ignore_errors=True)


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
    from fedskew.files import read_text

    text = read_text(path, "metrics log", own=True, limit=MAX_LOG) if os.path.lexists(path) else ""
    *complete, torn = text.split("\n")  # torn: what follows the last newline ("" after a clean append)
    records = []
    for i, line in enumerate(complete):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("round"), int):
                raise ValueError("not a round record")
        except (ValueError, RecursionError):
            if i == len(complete) - 1 and not torn:
                break
            raise ConfigError(f"'{path}' line {i + 1} is not a round record (the file was edited or corrupted); "
                              f"start the run again in a new run directory.") from None
        records.append(rec)
    return records


__all__ = ["FolderLock", "append_line", "blocking_file", "atomic_save", "atomic_write_text", "fsync_folder",
           "read_records", "replace_folder"]
