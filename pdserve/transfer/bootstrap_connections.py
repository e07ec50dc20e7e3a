"""A bound on the connections to a prefill worker's bootstrap port. Torch-free.

libzmq accepts every TCP connection to a ROUTER and keeps it for as long as the peer does,
and has no way to close one connection of a ROUTER. It does two things we use: it asks a
ZAP handler (RFC 27, `inproc://zeromq.zap.01` in the socket's context) at every new
connection's handshake, once a ZAP domain is set, and closes the connection if the handler
says no; and a socket monitor reports each connection accepted and each one that went away.
So the IO thread counts the connections open (accepted, not yet gone) from the monitor and
refuses a handshake while more than `limit` are open, or more than `limit_per_host` from the
connection's source address (so that one host cannot take every place: the decode workers
of other hosts still get in); a connection that never handshakes is closed by libzmq after
`handshake_timeout_s` (ZMQ_HANDSHAKE_IVL), so it holds its place that long at most. A
connection refused at its handshake is not tried again by libzmq; the decode side reports it
by name (decode_peers).

The monitor's accept and disconnect events carry the connection's file descriptor: at accept
we read the peer's address from a duplicate of it (closed at once), and count by address.
NOTE: libzmq reports a connection's disconnect before it closes its descriptor, and the
context's one IO thread reports both in order, so a descriptor reused by a later connection
is counted afresh.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import uuid
from collections import Counter

import zmq
from zmq.utils.monitor import parse_monitor_message

from pdserve.protocol.log_limit import RateLimitedLog

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"pdserve-bootstrap"
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


class ConnectionLimit:
    """Counts and caps the connections of one ROUTER socket. Create it before the socket
    binds; everything else runs on the thread that polls `sockets` (the IO thread)."""

    def __init__(
        self,
        context: zmq.Context,
        router: zmq.Socket,
        limit: int,
        limit_per_host: int,
        handshake_timeout_s: float,
        log: RateLimitedLog,
    ):
        self.limit = limit
        self.limit_per_host = limit_per_host
        self.refused = 0  # handshakes refused, in all
        # The connections accepted and not gone: source address by file descriptor.
        self._address_of: dict[int, str] = {}
        self.open_from: Counter[str] = Counter()
        self._log = log
        self._router = router
        router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        router.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(handshake_timeout_s * 1000)))
        self.zap = context.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)
        address = f"inproc://bootstrap-monitor-{uuid.uuid4().hex}"
        router.monitor(address, _EVENTS)
        self.monitor = context.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.LINGER, 0)
        # NOTE: no high-water mark: a dropped event would leave the count wrong for good.
        self.monitor.setsockopt(zmq.RCVHWM, 0)
        self.monitor.connect(address)

    @property
    def open(self) -> int:
        """Connections accepted and not gone."""
        return len(self._address_of)

    @property
    def sockets(self) -> tuple[zmq.Socket, zmq.Socket]:
        return self.monitor, self.zap

    def on_socket(self, socket: zmq.Socket) -> bool:
        """Handle what is ready on `socket` if it is ours (True)."""
        if socket is not self.monitor and socket is not self.zap:
            return False
        self._count()
        self._answer()
        return True

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._router.disable_monitor()
        self.monitor.close(0)
        self.zap.close(0)

    def _count(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._forget(fd)  # NOTE: none there unless an event was lost
                self._address_of[fd] = address = peer_address(fd)
                self.open_from[address] += 1
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._forget(fd)

    def _forget(self, fd: int) -> None:
        address = self._address_of.pop(fd, None)
        if address is not None:
            self.open_from[address] -= 1
            if self.open_from[address] <= 0:
                del self.open_from[address]

    def _answer(self) -> None:
        """Answer the ZAP requests waiting; the connection being asked about is counted
        already (its accept came first)."""
        while True:
            try:
                request = self.zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(request) < 6 or request[0] != b"1.0":
                # NOTE: only libzmq talks to this inproc address; answer so REP goes on.
                self.zap.send_multipart([b"1.0", b"", b"400", b"bad request", b"", b""])
                continue
            request_id, address = request[1], normal_address(request[3].decode(errors="replace"))
            self._count()  # NOTE: a connection that left since counts no more
            problem = self._over_limit(address)
            if problem is None:
                self.zap.send_multipart([b"1.0", request_id, b"200", b"OK", b"", b""])
                continue
            self.refused += 1
            self._log.warning(
                "refused a connection to the bootstrap port from %s: %s", address, problem
            )
            self.zap.send_multipart([b"1.0", request_id, b"400", b"too many connections", b"", b""])

    def _over_limit(self, address: str) -> str | None:
        """Why a new connection from `address` (counted already) is one too many, if it is."""
        if self.open > self.limit:
            return f"{self.open} connections open (limit {self.limit})"
        if self.open_from[address] > self.limit_per_host:
            return (
                f"{self.open_from[address]} connections open from it (limit "
                f"{self.limit_per_host} a host)"
            )
        return None


def normal_address(address: str) -> str:
    """One spelling of an IP address (an IPv4 address mapped into IPv6 as IPv4; no zone)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def peer_address(fd: int) -> str:
    """The source address of the connection on descriptor `fd`, read from a duplicate; "?"
    if it is gone already (its disconnect follows)."""
    try:
        duplicate = os.dup(fd)
    except OSError:
        return "?"
    try:
        connection = socket.socket(fileno=duplicate)  # NOTE: closes the duplicate, not `fd`
    except OSError:  # not a socket any more
        os.close(duplicate)
        return "?"
    with connection:
        try:
            return normal_address(connection.getpeername()[0])
        except OSError:
            return "?"
