"""The `memory` backend: both workers in one process (tests), a piece's bytes handed over
through a process-wide registry instead of a socket (`memory_plane`), from and into host
memory. Never a `--transfer-backend` choice: a launched worker is a process of its own."""

from __future__ import annotations

from pdserve.transfer.backends.base import Backend
from pdserve.transfer.backends.memory.memory_plane import MemoryReceivePlane, MemorySendPlane


class MemoryBackend(Backend):
    def send_plane(self, server, device, fanout, pools) -> MemorySendPlane:
        return MemorySendPlane(server)

    def receive_plane(self, client, device, fanout, pools, metadata_bytes) -> MemoryReceivePlane:
        return MemoryReceivePlane(client)
