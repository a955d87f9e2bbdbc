"""A watchdog process that ends what its owner started when the owner dies, however it dies.

:class:`Reaper` starts ``python -c`` in its own session, reading lines from a pipe whose only
writer is the owner. The owner tells it the processes (``watch(pid)``) and process groups
(``watch(pid, group=True)``) it starts; when the pipe reaches end of file without an orderly
``close`` (the owner was killed, even with SIGKILL, or crashed), the watchdog sends SIGKILL to each
of them that still exists, and to every PID listed in the ``*.pid`` files of its ``pid_dirs``
(processes started detached by someone else, such as Flower's resident workers). ``close(kill=True)``
does the same at once and returns the PIDs it found alive.

PIDs are reused (``/proc/sys/kernel/pid_max`` is 32,768 on some machines), so the watchdog reads each
process's start time (``/proc/PID/stat``) when it is told of it and kills a PID only while that
start time still matches. A process group is killed while its leader is the process it was told of,
or when the leader is gone (Linux keeps a group's number reserved while any member lives, so a
group number whose leader PID now belongs to another process has no members left).
"""

from __future__ import annotations

import subprocess
import sys

_WATCHDOG = r'''
import os, signal, sys
from pathlib import Path

def started(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None

def ours(pid, when):
    now = started(pid)
    return now is not None and now == when

watched, kill = [], True  # end of file without an orderly "q": the owner died
for line in sys.stdin:
    kind, pid = line.split()
    if kind == "q":
        kill = pid == "1"
        break
    watched.append((kind, int(pid), started(int(pid))))
killed = []
if kill:
    for kind, pid, when in watched:
        try:
            if kind == "g" and (ours(pid, when) or started(pid) is None):
                os.killpg(pid, signal.SIGKILL)
                killed.append(pid)
            elif kind == "p" and ours(pid, when):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    for folder in sys.argv[1:]:
        for pidfile in Path(folder).glob("*.pid"):
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
                killed.append(int(pidfile.read_text()))
            except (OSError, ValueError):
                pass
try:
    print(" ".join(map(str, killed)), flush=True)
except OSError:  # the owner is gone: nobody reads
    pass
'''


class Reaper:
    """``watch`` what you start; it is killed if this process dies before ``close``."""

    def __init__(self, pid_dirs: tuple = ()):
        self.proc = subprocess.Popen([sys.executable, "-c", _WATCHDOG, *map(str, pid_dirs)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True, close_fds=True)

    def watch(self, pid: int, group: bool = False) -> None:
        """Kill ``pid`` (its whole process group with ``group``) if this process dies first."""
        if self.proc.poll() is None:
            self.proc.stdin.write(f"{'g' if group else 'p'} {pid}\n")
            self.proc.stdin.flush()

    def close(self, kill: bool = False) -> list[int]:
        """End the watchdog: it kills nothing, or (``kill``) everything watched that still runs; the
        PIDs it found alive and killed."""
        if self.proc.poll() is not None:
            return []
        try:
            self.proc.stdin.write("q 1\n" if kill else "q 0\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        out = self.proc.stdout.read()
        self.proc.stdout.close()
        self.proc.wait(timeout=30)
        return [int(p) for p in out.split()]


__all__ = ["Reaper"]
