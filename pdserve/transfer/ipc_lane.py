"""The `ipc` backend's announcement lane: a Unix datagram socket from the prefill worker's
engine thread straight to the decode worker's IO thread. Torch-free.

With `ipc` the KV needs no transport, so what a handoff waits for beyond the copy is the
announcement's trip: over the peer's ZMQ connection it takes a hop to prefill's IO thread,
ZMQ's own IO threads on both sides and TCP (~0.2-0.35 ms on the H100 hosts measured). On the
lane the engine thread that queued the copy sends `KVPiece`, the metadata record and
`RoomDone` itself, one datagram each, and decode's IO thread, which polls the lane beside its
connections, takes them as it takes the connection's.

Decode binds the lane in the abstract socket namespace and names it in `Register`; prefill
connects to it when it maps decode's pools. The kernel stamps each datagram with its sender's
process id (`SO_PASSCRED`), so decode takes a datagram only from a prefill process it
registered with (the handshake checked both share a host and a PID namespace): another
process on the host cannot announce pages. A Unix datagram socket drops nothing and keeps
order; a sender whose receiver stopped reading gets EAGAIN, and the room fails. Where the lane
cannot be had (another network namespace, or a metadata record too large for one datagram)
everything goes over the connection, as before.

A datagram is one message: its body's length (4 bytes, little-endian), the body (the codec's
encoding), then the payload, if any (the metadata record's bytes).
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import struct
import threading

from pdserve.protocol.codec import ProtocolError, decode, encode
from pdserve.protocol.transfer_messages import KVPiece, MetadataHeader, RoomDone

LANE_PREFIX = "\0pdserve-lane-"
MAX_DATAGRAM = 64 << 10  # the largest datagram either side sends or takes
LANE_MESSAGES = (KVPiece, MetadataHeader, RoomDone)
# NOTE: what a datagram needs beyond its payload: a KVPiece with its 64-byte event, or a
# metadata header with its top logprobs, is well under this.
_HEADROOM = 8 << 10
_LENGTH = struct.Struct("<I")
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_MAX_PER_POLL = 256  # datagrams taken per wake-up, so the connections get their turn


def lane_fits(metadata_bytes: int) -> bool:
    """Whether a metadata record of this many payload bytes fits one datagram."""
    return metadata_bytes + _HEADROOM <= MAX_DATAGRAM


def lane_address_problem(address: str) -> str | None:
    """What is wrong with a lane address a peer sent, if anything."""
    if not address.startswith(LANE_PREFIX) or len(address.encode()) > 107:
        return f"decode's announcement lane {address!r} is not a pdserve lane address"
    return None


class LaneReceiver:
    """Decode's end: bound at once; `fileno()` goes into the IO thread's poller."""

    def __init__(self):
        self.address = LANE_PREFIX + secrets.token_hex(12)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._socket.setblocking(False)
        self._socket.bind(self.address)
        # NOTE: one buffer for every datagram, +1 byte to tell an oversize one (it is cut).
        self._buffer = bytearray(MAX_DATAGRAM + 1)
        self._view = memoryview(self._buffer)

    def fileno(self) -> int:
        return self._socket.fileno()

    def receive(self) -> list[tuple[int, object, bytes | None] | tuple[int, str]]:
        """The datagrams waiting (IO thread): (sender pid, message, payload), or (sender pid,
        what is wrong with it) for one that is malformed."""
        out = []
        space = socket.CMSG_SPACE(_CREDENTIALS.size)
        for _ in range(_MAX_PER_POLL):
            try:
                size, ancillary, _, _ = self._socket.recvmsg_into([self._view], space)
            except (BlockingIOError, InterruptedError):
                break
            pid = 0
            for level, kind, value in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = _CREDENTIALS.unpack_from(value)[0]
            if size > MAX_DATAGRAM:
                out.append((pid, f"a datagram over {MAX_DATAGRAM} bytes"))
                continue
            out.append((pid, *_parse(bytes(self._view[:size]))))
        return out

    def close(self) -> None:
        self._socket.close()


def _parse(data: bytes) -> tuple[object, bytes | None] | tuple[str]:
    if len(data) < _LENGTH.size:
        return (f"a datagram of {len(data)} bytes",)
    (length,) = _LENGTH.unpack_from(data)
    if length > len(data) - _LENGTH.size:
        return (f"a datagram announcing a {length}-byte message in {len(data)} bytes",)
    body_end = _LENGTH.size + length
    try:
        msg = decode(data[_LENGTH.size : body_end], LANE_MESSAGES)
    except ProtocolError as e:
        return (str(e),)
    payload = data[body_end:]
    if payload and not isinstance(msg, MetadataHeader):
        return (f"a {type(msg).__name__} with a payload",)
    return msg, (payload if isinstance(msg, MetadataHeader) else None)


class LaneSender:
    """Prefill's end, one per decode peer; `send` is safe from any thread."""

    def __init__(self, address: str):
        """OSError if the lane cannot be reached (e.g. decode is in another network
        namespace)."""
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._socket.connect(address)
        except OSError:
            self._socket.close()
            raise
        self._lock = threading.Lock()
        self._closed = False

    def send(self, msg, payload: bytes = b"") -> str | None:
        """Send one message without blocking; what went wrong, if it was not sent."""
        body = encode(msg)
        datagram = b"".join((_LENGTH.pack(len(body)), body, payload))
        if len(datagram) > MAX_DATAGRAM:
            return f"a {type(msg).__name__} of {len(datagram)} bytes does not fit the lane"
        # NOTE: under the lock so that `close` never frees the descriptor under a send.
        with self._lock:
            if self._closed:
                return "the connection to decode was dropped"
            try:
                self._socket.send(datagram, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return "decode stopped taking announcements (its lane is full)"
            except OSError as e:
                return f"decode's announcement lane failed: {e}"
        return None

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                with contextlib.suppress(OSError):
                    self._socket.close()
