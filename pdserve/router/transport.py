"""The router's connections to workers, and how fast they notice a dead worker.

A worker whose host or link dies sends nothing more: no FIN, no reset. Without help, a
request waiting on it would hang until the request deadline (600 s by default), and a stream
would stall as long. Two kernel timers end such connections within `dead_worker_timeout_s`
instead, without misjudging a worker that is merely slow (its kernel still answers):
TCP keepalive probes for an idle connection (a stream waiting for its next token, a prefill
still computing), and TCP_USER_TIMEOUT for data the worker never acknowledges (a request
sent into a cut link). The failed connection then fails its leg like any unreachable worker:
a failure counted against it (enough in a row take it out of rotation), retried on a new
pair when nothing was sent yet, an SSE error event otherwise. Torch-free.
"""

from __future__ import annotations

import socket

import httpx


def dead_peer_socket_options(timeout_s: float) -> list[tuple[int, int, int]]:
    """Keepalive that declares a silent peer dead after about `timeout_s` seconds (first
    probe after a third of it, then three probes), and the same bound on unacknowledged
    data. Options this platform lacks are left out (Linux has them all)."""
    idle = max(1, int(timeout_s / 3))
    interval = max(1, int((timeout_s - idle) / 3))
    wanted = [
        (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPIDLE", idle),
        (socket.IPPROTO_TCP, "TCP_KEEPINTVL", interval),
        (socket.IPPROTO_TCP, "TCP_KEEPCNT", 3),
        (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", int(timeout_s * 1000)),
    ]
    return [(level, getattr(socket, name), value) for level, name, value in wanted
            if hasattr(socket, name)]  # fmt: skip


def worker_transport(dead_worker_timeout_s: float) -> httpx.AsyncHTTPTransport:
    """httpx's transport with the dead-peer options (health checks and model info; legs go
    through `http1.Http1Pool`, which sets the same options)."""
    return httpx.AsyncHTTPTransport(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        socket_options=dead_peer_socket_options(dead_worker_timeout_s),
    )
