"""The resident per-node worker behind :mod:`fedskew.flower.client` (see there).

    python -m fedskew.flower.worker SOCKET KEYFILE CONFIGFILE

Serves ``("train", client, round, lr, payload, client_state, download)`` requests (numpy arrays) with the
same ``train_client`` as every other path, replying ``("ok", upload, new_state, report)`` or
``("error", message)``; exits after ``FEDSKEW_WORKER_IDLE`` seconds without a request.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Listener
from pathlib import Path


def main(sock: str, keyfile: str, cfgfile: str) -> None:
    import gc

    import torch

    gc.freeze()  # (torch's objects, alive as long as the worker: as the command line does, see fedskew.cli)
    torch.set_num_threads(int(os.environ.get("FEDSKEW_WORKER_THREADS", "1")))
    from fedskew.flower.app import _runtime, report_of

    cfg_json = Path(cfgfile).read_text()
    rt = _runtime(cfg_json)  # torch, data, model, method: loaded once
    idle = float(os.environ.get("FEDSKEW_WORKER_IDLE", "900"))
    last = [time.time()]

    pidfile = Path(keyfile).with_suffix(".pid")  # beside the key (the socket may live in a short folder)

    def watchdog():
        while time.time() - last[0] < idle:
            time.sleep(min(idle, 5.0))
        Path(sock).unlink(missing_ok=True)
        pidfile.unlink(missing_ok=True)
        os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    pidfile.write_text(str(os.getpid()))  # for whoever must stop it
    tmp = sock + ".tmp"
    Path(tmp).unlink(missing_ok=True)
    listener = Listener(tmp, family="AF_UNIX", authkey=Path(keyfile).read_bytes())
    os.replace(tmp, sock)  # visible only once it accepts
    while True:
        conn = listener.accept()
        last[0] = time.time()
        try:
            _, k, round_idx, lr, payload, state, download = conn.recv()
            def tensors(arrays):
                return (None if arrays is None else {key: torch.from_numpy(v.copy())
                                                                              for key, v in arrays.items()})
            result = rt.train(k, round_idx, lr, tensors(payload), tensors(state), tensors(download))
            conn.send(("ok", {key: v.detach().cpu().numpy() for key, v in result.upload.items()},
                       {key: v.detach().cpu().numpy() for key, v in result.client_state.items()}, report_of(result)))
        except Exception as exc:  # the ClientApp raises it, Flower reports the client as failed
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
        finally:
            conn.close()
            last[0] = time.time()


if __name__ == "__main__":
    main(*sys.argv[1:4])
