"""The `tcp` backend: KV bytes as ZMQ frames on the control connection (`tcp_plane`), from
and into host memory; works anywhere the bootstrap port is reachable."""

from __future__ import annotations

from pdserve.transfer.backends.base import Backend
from pdserve.transfer.backends.tcp.tcp_plane import TcpPlane


class TcpBackend(Backend):
    def send_plane(self, server, device, fanout, pools) -> TcpPlane:
        return TcpPlane(server)

    def receive_plane(self, client, device, fanout, pools, metadata_bytes) -> TcpPlane:
        return TcpPlane(client)
