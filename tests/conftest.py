import gc
import gzip
import os
import signal
import struct
import subprocess

import numpy as np
import pytest
import torch

from fedskew.engine.reaper import Reaper

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # A test run started in the background of a non-interactive shell (`sh -c 'pytest &'`, nohup)
    # inherits SIGINT ignored, and so would every fedskew process the tests start: Python keeps an
    # inherited SIG_IGN, and the Ctrl-C tests would see their runs ignore the signal. Python's own
    # handler here makes the children start with the default disposition (a handler resets on exec).
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _compile_the_package() -> None:
    """The package's modules compiled to bytecode once, as a user's Python caches them after a first
    command. The suite starts hundreds of Python processes; where PYTHONDONTWRITEBYTECODE is set (some
    containers and CI images set it) each would otherwise compile fedskew's modules from source again
    (about 0.3 s a process). Python reads caches it finds whatever that variable says."""
    import compileall
    from pathlib import Path

    import fedskew

    try:
        compileall.compile_dir(Path(fedskew.__file__).parent, quiet=2)
    except OSError:  # (an installed, read-only package: it was compiled at install)
        pass


_compile_the_package()
# torch's objects live as long as the test process: frozen, the garbage collector's full passes stop
# scanning them (as the command line does, see fedskew.cli)
gc.freeze()


if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on two cores: one torch thread each, and for the processes they start (a test that
    # compares thread counts sets its own)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# Every process a test starts from this process (tests, and fedskew code they call in-process:
# LocalFederation, Ray) is watched by a Reaper: if the test run is killed, even with SIGKILL, the
# watchdog kills them (their whole process group when they have their own); at the end of the
# session it kills whatever is still running, and the session reports it as a failure.
_SESSION_PID = os.getpid()
_REAPER = Reaper()
_popen_init = subprocess.Popen.__init__


def _watched_popen_init(self, *args, **kwargs):
    _popen_init(self, *args, **kwargs)
    if os.getpid() == _SESSION_PID and _REAPER.proc.poll() is None:
        try:
            own_group = os.getpgid(self.pid) == self.pid
        except ProcessLookupError:  # already gone
            return
        _REAPER.watch(self.pid, group=own_group)


subprocess.Popen.__init__ = _watched_popen_init


def pytest_collection_modifyitems(config, items):
    """The slow tests first, the quick ones after (each kind in its own order): the two workers share
    the long tests early and the quick ones fill the end evenly. In collection order a long test
    collected near the end (torch.compile's, over a minute) ran alone while the other worker idled."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_sessionfinish(session, exitstatus):
    left = _REAPER.close(kill=True)
    if left and session.config.option.verbose >= 0:
        print(f"\nconftest: {len(left)} process(es) the tests started were still running and were killed: "
              f"{left}")
        if exitstatus == 0:
            session.exitstatus = 1


def write_idx(path, array: np.ndarray, gz: bool = True, truncate: int = 0) -> None:
    """Write ``array`` (uint8) in the IDX format (optionally gzipped, optionally cut short)."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(">" + "I" * array.ndim, *array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    if truncate:
        raw = raw[:-truncate]
    (gzip.open if gz else open)(path, "wb").write(raw)


@pytest.fixture
def idx_folder(tmp_path):
    """A small MNIST-format folder: 120 train / 40 test images of 28x28, labels 0..9."""
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 120), ("t10k", 40)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, size=(n, 28, 28)))
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    return tmp_path


@pytest.fixture
def one_torch_thread():
    """Torch at one thread for the test (results that tests compare exactly depend on the count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def crash_after(round_idx):
    """An ``on_round`` callback that interrupts a run after round ``round_idx`` (as Ctrl-C would)."""
    def on_round(record):
        if record["round"] == round_idx:
            raise KeyboardInterrupt
    return on_round
