"""The transfer backends, one folder each (`base.Backend` is what one implements), and the
one place that reads a backend's name: `make_backend`. Adding a backend is its folder plus
its line in `_BACKEND_CLASSES`; the CLI's choices follow `CLI_BACKENDS`.

Torch-free: the settings import `BACKENDS`; a backend's module is imported when it is made.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.transfer.backends.base import Backend

# name -> "module:class"; nccl and gloo are one backend over two torch.distributed backends.
_BACKEND_CLASSES = {
    "tcp": "pdserve.transfer.backends.tcp.backend:TcpBackend",
    "nccl": "pdserve.transfer.backends.dist.backend:DistBackend",
    "gloo": "pdserve.transfer.backends.dist.backend:DistBackend",
    "ipc": "pdserve.transfer.backends.ipc.backend:IpcBackend",
    "memory": "pdserve.transfer.backends.memory.backend:MemoryBackend",
}
BACKENDS = tuple(_BACKEND_CLASSES)
# What `--transfer-backend` offers: not `memory`, whose two workers share one process (tests),
# which no launched worker does (`make_backend` and `TransferConfig` take every backend).
CLI_BACKENDS = tuple(name for name in BACKENDS if name != "memory")


def make_backend(config_or_name) -> Backend:
    """The backend a `TransferConfig` (or a backend name) asks for."""
    name = getattr(config_or_name, "backend", config_or_name)
    if name not in _BACKEND_CLASSES:
        raise ValueError(f"transfer backend must be one of {BACKENDS}, got {name!r}")
    module, cls = _BACKEND_CLASSES[name].split(":")
    return getattr(importlib.import_module(module), cls)(name)
