"""fedskew on Flower (optional extra ``pip install fedskew[flower]``; see docs/flower.md).

- :mod:`fedskew.flower.app`: the ServerApp (fedskew's round loop over Flower messages), the
  in-process ClientApp and :func:`~fedskew.flower.app.simulate` (Flower's simulation runtime);
- :mod:`fedskew.flower.client` / :mod:`fedskew.flower.worker`: the torch-free deployment
  ClientApp and its resident per-node worker;
- :mod:`fedskew.flower.federation`: the app directory for ``flwr run``, the connection file, and
  :class:`~fedskew.flower.federation.LocalFederation` (a real SuperLink and SuperNodes on
  127.0.0.1).

This package module imports nothing, so that the deployment ClientApp stays torch-free; the names
below are looked up on first use.
"""

_LAZY = {
    "simulate": "app",
    "check_supported": "app",
    "server_app": "app",
    "client_app": "app",
    "make_server_app": "app",
    "make_client_app": "app",
    "FlowerExecutor": "app",
    "LocalFederation": "federation",
    "write_app": "federation",
    "write_connection": "federation",
    "flower_env": "federation",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"fedskew.flower.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'fedskew.flower' has no attribute '{name}'")


__all__ = sorted(_LAZY)
