"""One ZMQ socket speaking our wire messages (`pdserve.protocol.codec`), set up in one place.

Every socket that carries wire messages is a `Channel`: the engine process's inbox and outbox,
the front end's pair to them, the transfer ROUTER (prefill) and DEALERs (decode). Options are
set once, here: LINGER 0 (closing never waits for a peer that is gone), MAXMSGSIZE if given
(ZMQ drops the connection of a peer that sends a larger frame, before allocating it; the limit
is per frame, payload frames included), SNDTIMEO if given, ROUTER_MANDATORY on a ROUTER (a send
to an unknown peer raises EHOSTUNREACH instead of vanishing), IPV6 for "tcp://[" addresses.

A message on the wire is [identity (ROUTER only)] + [encoded message] + payload frames (at
most `max_payload_frames`, e.g. a KV chunk sent with copy=False):

    Channel(context, socket_type, accepts=(), *, max_payload_frames=0,
            max_message_bytes=None, send_timeout_ms=None)
    .bind(address) / .bind_random_port("tcp://host") -> port / .connect(address)
    .frames(msg, *payload, to=None) -> list   # what send puts on the wire; `to` on a ROUTER
    .send(msg, *payload, to=None, flags=0, copy=True)
    .receive(flags=0, copy=True) -> Received(msg, sender, payload, address)
    await .receive_async(flags=0, copy=True)  # the same, on a zmq.asyncio context's socket
    .socket (for pollers), .close()

`frames` is for callers that queue sends themselves (the transfer IO thread never blocks on
one peer: it hands these frames to `socket.send_multipart(..., zmq.NOBLOCK)` when it can).
`receive` raises ProtocolError for a message with the wrong number of frames, an undecodable
body or a type outside `accepts` (the message is consumed; the caller logs it and goes on), and
lets zmq.Again through under zmq.NOBLOCK. A send-only channel accepts nothing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import zmq

from pdserve.protocol.codec import ProtocolError, decode, encode


class Received(NamedTuple):
    msg: Any
    sender: bytes | None  # the peer's identity on a ROUTER, else None
    payload: tuple  # the frames after the message: bytes, or zmq.Frame with copy=False
    address: str | None = None  # the peer's IP address on a ROUTER received with copy=False


class Channel:
    """One ZMQ socket: set up once, encodes what it sends, type-checks what it receives."""

    def __init__(
        self,
        context: zmq.Context,
        socket_type: int,
        accepts: tuple[type, ...] = (),
        *,
        max_payload_frames: int = 0,
        max_message_bytes: int | None = None,
        send_timeout_ms: int | None = None,
    ):
        self.accepts = accepts
        self.max_payload_frames = max_payload_frames
        self.routed = socket_type == zmq.ROUTER
        self.socket = context.socket(socket_type)
        self.socket.setsockopt(zmq.LINGER, 0)
        if self.routed:
            self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if max_message_bytes is not None:
            self.socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if send_timeout_ms is not None:
            self.socket.setsockopt(zmq.SNDTIMEO, send_timeout_ms)

    def bind(self, address: str) -> None:
        self._ipv6_for(address)
        self.socket.bind(address)

    def bind_random_port(self, host: str) -> int:
        """Bind `host` ("tcp://127.0.0.1", "tcp://[::1]") on a free port; returns the port."""
        self._ipv6_for(host)
        return self.socket.bind_to_random_port(host)

    def connect(self, address: str) -> None:
        self._ipv6_for(address)
        self.socket.connect(address)

    def _ipv6_for(self, address: str) -> None:
        if address.startswith("tcp://["):
            self.socket.setsockopt(zmq.IPV6, 1)

    def frames(self, msg: Any, *payload: Any, to: bytes | None = None) -> list:
        """The frames `send` would put on the wire: the peer's identity first on a ROUTER."""
        if self.routed != (to is not None):
            raise ValueError("a ROUTER sends to a peer (to=identity); other sockets take no `to`")
        head = [to] if self.routed else []
        return [*head, encode(msg), *payload]

    def send(
        self, msg: Any, *payload: Any, to: bytes | None = None, flags: int = 0, copy: bool = True
    ) -> None:
        """Send one message; zmq.Again when the send timeout passes (or under NOBLOCK)."""
        self.socket.send_multipart(self.frames(msg, *payload, to=to), flags, copy=copy)

    def receive(self, flags: int = 0, copy: bool = True) -> Received:
        return self._parse(self.socket.recv_multipart(flags, copy=copy))

    async def receive_async(self, flags: int = 0, copy: bool = True) -> Received:
        """`receive` for a socket of a zmq.asyncio context."""
        return self._parse(await self.socket.recv_multipart(flags, copy=copy))

    def close(self, linger_ms: int = 0) -> None:
        """linger_ms: how long messages still queued may take to leave (0: dropped)."""
        self.socket.close(linger=linger_ms)

    def _parse(self, frames: list) -> Received:
        address = _peer_address(frames[0]) if self.routed and frames else None
        sender = _bytes(frames.pop(0)) if self.routed and frames else None
        if not 1 <= len(frames) <= 1 + self.max_payload_frames:
            raise ProtocolError(
                f"a message of {len(frames)} frames (expected 1 to {1 + self.max_payload_frames})"
            )
        msg = decode(_bytes(frames[0]), self.accepts)
        return Received(msg, sender, tuple(frames[1:]), address)


def _peer_address(frame: bytes | zmq.Frame) -> str | None:
    if isinstance(frame, bytes):
        return None
    try:
        return frame.get("Peer-Address")
    except zmq.ZMQError:  # NOTE: not a TCP connection (inproc, ipc)
        return None


def _bytes(frame: bytes | zmq.Frame) -> bytes:
    return frame if isinstance(frame, bytes) else frame.bytes


__all__ = ["Channel", "Received"]
