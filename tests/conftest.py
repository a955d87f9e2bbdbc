import gzip
import signal
import struct

import numpy as np
import pytest


if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # A test run started in the background of a non-interactive shell (`sh -c 'pytest &'`, nohup)
    # inherits SIGINT ignored, and so would every fedskew process the tests start: Python keeps an
    # inherited SIG_IGN, and the Ctrl-C tests would see their runs ignore the signal. Python's own
    # handler here makes the children start with the default disposition (a handler resets on exec).
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


def crash_after(round_idx):
    """An ``on_round`` callback that interrupts a run after round ``round_idx`` (as Ctrl-C would)."""
    def on_round(record):
        if record["round"] == round_idx:
            raise KeyboardInterrupt
    return on_round
