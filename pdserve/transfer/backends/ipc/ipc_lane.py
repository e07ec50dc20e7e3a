"""The `ipc` backend's announcement lane: a Unix sequenced-packet connection from the prefill
worker's engine thread straight to the decode worker's IO thread. Torch-free.

With `ipc` the KV needs no transport, so what a handoff waits for beyond the copy is the
announcement's trip: over the peer's ZMQ connection it takes a hop to prefill's IO thread,
ZMQ's own IO threads on both sides and TCP (~0.2-0.35 ms on the H100 hosts measured). On the
lane the engine thread that queued the copy sends `KVPiece`, the metadata record and
`RoomDone` itself, one packet each, and decode's IO thread, which polls the lane beside its
connections, takes them as it takes the connection's.

Decode listens in the abstract socket namespace and names the address in `Register`; prefill
connects when it maps decode's pools. The kernel gives decode the connecting process's id
(`SO_PEERCRED`): decode closes a connection from any process but a prefill peer's as it
accepts it, and takes a packet only from a prefill process it registered with (the handshake
checked both share a host and a PID namespace), so another process on the host can neither
announce pages nor hold a connection. The connection drops nothing and keeps order. A sender
whose receiver stopped reading waits for room, up to its deadline, and the room fails after
it; nothing waits longer. (Datagrams would do but for their queue: a Unix datagram socket
holds only `net.unix.max_dgram_qlen` of them, 10 by default, which a busy decode filled under
CI's load; a connection holds a few hundred announcements.) Where the lane cannot be had
(another network namespace, or a metadata record too large for one packet) everything goes
over the connection, as before.

A packet holds one message or several: each its body's length and its payload's (4 bytes
each, little-endian), the body (the codec's encoding), then the payload, if any (the metadata
record's bytes). A room's last piece, its metadata record and `RoomDone` go in one packet
(`LaneSender.hold`): one send and one wake-up of decode's IO thread instead of three.
"""

from __future__ import annotations

import contextlib
import secrets
import select
import socket
import struct
import threading
from collections.abc import Callable

import zmq

from pdserve.protocol.codec import ProtocolError, decode, encode
from pdserve.protocol.transfer_messages import KVPiece, MetadataHeader, RoomDone

LANE_PREFIX = "\0pdserve-lane-"
MAX_PACKET = 64 << 10  # the largest packet either side sends or takes
LANE_MESSAGES = (KVPiece, MetadataHeader, RoomDone)
# NOTE: what a packet needs beyond its payload: a KVPiece with its 64-byte event, or a
# metadata header with its top logprobs, is well under this.
_HEADROOM = 8 << 10
_LENGTHS = struct.Struct("<II")  # a message's body and payload
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_MAX_PER_POLL = 256  # packets taken per wake-up, so the connections get their turn
MAX_LANE_CONNECTIONS = 64  # by default; decode allows twice its prefill peers


def lane_fits(metadata_bytes: int) -> bool:
    """Whether a metadata record of this many payload bytes fits one packet."""
    return metadata_bytes + _HEADROOM <= MAX_PACKET


def lane_address_problem(address: str) -> str | None:
    """What is wrong with a lane address a peer sent, if anything."""
    if not address.startswith(LANE_PREFIX) or len(address.encode()) > 107:
        return f"decode's announcement lane {address!r} is not a pdserve lane address"
    return None


class LaneReceiver:
    """Decode's end: listens at once; its descriptors go into `poller` (the IO thread's)."""

    def __init__(
        self,
        poller: zmq.Poller,
        wanted: Callable[[int], bool],
        max_connections: int = MAX_LANE_CONNECTIONS,
    ):
        """wanted(pid): whether a connection from that process is kept (a prefill peer's:
        anyone else's is closed as it is accepted, so it holds nothing)."""
        self.address = LANE_PREFIX + secrets.token_hex(12)
        self._poller = poller
        self._wanted = wanted
        self._max_connections = max_connections
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.setblocking(False)
        self._listener.bind(self.address)
        self._listener.listen(16)
        poller.register(self._listener.fileno(), zmq.POLLIN)
        self._connections: dict[int, tuple[socket.socket, int]] = {}  # fd: (socket, pid)
        # NOTE: one buffer for every packet; a longer one is cut and flagged (MSG_TRUNC).
        self._view = memoryview(bytearray(MAX_PACKET))

    def owns(self, fd) -> bool:
        return fd == self._listener.fileno() or fd in self._connections

    def read(self, fd: int) -> list[tuple[int, object, bytes | None] | tuple[int, str]]:
        """What `fd` has (IO thread): the packets waiting on a connection as (sender pid,
        message, payload), or (sender pid, what is wrong with it) for one that is malformed;
        on the listener, the connections it accepted (nothing) or refused (what went wrong)."""
        if fd == self._listener.fileno():
            return self._accept()
        if fd not in self._connections:
            return []  # NOTE: dropped since the poll
        connection, pid = self._connections[fd]
        out = []
        for _ in range(_MAX_PER_POLL):
            try:
                size, _, flags, _ = connection.recvmsg_into([self._view])
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                size, flags = 0, 0
            if size == 0:  # the sender closed its end
                self._drop(fd)
                break
            if flags & socket.MSG_TRUNC:
                out.append((pid, f"a packet over {MAX_PACKET} bytes"))
                continue
            out += [(pid, *parsed) for parsed in _parse(bytes(self._view[:size]))]
        return out

    def close(self) -> None:
        for fd in list(self._connections):
            self._drop(fd)
        if self._listener.fileno() >= 0:
            self._poller.unregister(self._listener.fileno())
            self._listener.close()

    def _accept(self) -> list[tuple[int, str]]:
        refused = []
        while True:
            try:
                connection, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return refused
            credentials = connection.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size
            )
            pid = _CREDENTIALS.unpack(credentials)[0]
            if not self._wanted(pid) or len(self._connections) >= self._max_connections:
                connection.close()
                refused.append((pid, f"a lane connection refused ({len(self._connections)} open)"))
                continue
            connection.setblocking(False)
            self._connections[connection.fileno()] = (connection, pid)
            self._poller.register(connection.fileno(), zmq.POLLIN)

    def _drop(self, fd: int) -> None:
        connection, _ = self._connections.pop(fd)
        self._poller.unregister(fd)
        connection.close()


def _parse(data: bytes) -> list[tuple[object, bytes | None] | tuple[str]]:
    """A packet's messages as (message, payload); a malformed one as (what is wrong,), and
    nothing after it (where the next one would start is not known)."""
    out, offset = [], 0
    while offset < len(data):
        if len(data) - offset < _LENGTHS.size:
            return [*out, (f"a message of {len(data) - offset} bytes in a packet",)]
        length, payload_length = _LENGTHS.unpack_from(data, offset)
        body_start = offset + _LENGTHS.size
        offset = body_start + length + payload_length
        if offset > len(data):
            message = f"a {length}+{payload_length}-byte message in a packet of {len(data)} bytes"
            return [*out, (message,)]
        try:
            msg = decode(data[body_start : body_start + length], LANE_MESSAGES)
        except ProtocolError as e:
            return [*out, (str(e),)]
        if payload_length and not isinstance(msg, MetadataHeader):
            return [*out, (f"a {type(msg).__name__} with a payload",)]
        payload = data[body_start + length : offset] if isinstance(msg, MetadataHeader) else None
        out.append((msg, payload))
    return out or [("an empty packet",)]


class LaneSender:
    """Prefill's end, one per decode peer; `send` is safe from any thread."""

    def __init__(self, address: str, wait_s: float):
        """wait_s: how long a send waits for decode to take earlier packets. OSError if
        the lane cannot be reached (e.g. decode is in another network namespace)."""
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._socket.connect(address)
        except OSError:
            self._socket.close()
            raise
        self._socket.setblocking(False)
        self._wait_ms = max(1, int(wait_s * 1000))
        self._lock = threading.Lock()
        self._closed = False
        self._held = threading.local()

    def send(self, msg, payload: bytes = b"") -> str | None:
        """Send one message (or hold it, see `hold`); what went wrong, if it was not sent."""
        body = encode(msg)
        record = b"".join((_LENGTHS.pack(len(body), len(payload)), body, payload))
        if len(record) > MAX_PACKET:
            return f"a {type(msg).__name__} of {len(record)} bytes does not fit the lane"
        held = getattr(self._held, "records", None)
        if held is not None:
            held.append(record)
            return None
        return self._send(record)

    def hold(self) -> None:
        """Keep what this thread sends from now on, until `flush`."""
        self._held.records = []

    def flush(self) -> str | None:
        """Send what this thread held since `hold`, in as few packets as fit, in order; what
        went wrong, if anything (nothing after it is sent)."""
        records, self._held.records = self._held.records, None
        packet, problem = b"", None
        for record in records:
            if packet and len(packet) + len(record) > MAX_PACKET:
                problem = problem or self._send(packet)
                packet = b""
            packet += record
        if packet:
            problem = problem or self._send(packet)
        return problem

    def _send(self, packet: bytes) -> str | None:
        # NOTE: under the lock so that `close` never frees the descriptor under a send.
        with self._lock:
            if self._closed:
                return "the connection to decode was dropped"
            try:
                try:
                    self._socket.send(packet)
                except BlockingIOError:
                    # NOTE: decode is behind by a few hundred packets: wait for room, a while.
                    writable = select.poll()
                    writable.register(self._socket, select.POLLOUT)
                    if not writable.poll(self._wait_ms):
                        return f"decode took no announcement for {self._wait_ms} ms"
                    self._socket.send(packet)
            except OSError as e:
                return f"decode's announcement lane failed: {e}"
        return None

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                with contextlib.suppress(OSError):
                    self._socket.close()
