"""KV bytes as ZMQ frames on the control connection (the `tcp` backend): the sender sends the
room's buffer in `KVChunk`s of at most `chunk_bytes` (zero-copy views, kept alive by the room
until it ends), then the metadata record, then `RoomDone`; the receiver copies each chunk into
the room's buffer after checking it against its own reservation.

A data plane is what an endpoint calls for bytes: `send` (sender) or `handle` (either side, for
the plane's own messages), `registration` (receiver: what the plane adds to `Register`),
`registered` (sender: a peer was accepted), `forget` (a peer was dropped), `tick`, `close`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.protocol.failures import FailureKind
from pdserve.protocol.transfer_messages import KVChunk, Register, RoomDone

if TYPE_CHECKING:
    from pdserve.transfer.endpoint import Endpoint, Peer


class TcpPlane:
    pending_sends = 0

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint

    def send(self, room, kv, header, payload: bytes) -> None:
        """Sender: the room is TRANSFERRING."""
        endpoint, peer = self.endpoint, room.peer
        room.keep(kv)  # NOTE: the frames are zero-copy views: kept until the room ends
        view = memoryview(kv.numpy())
        total = kv.numel()
        for offset in range(0, total, endpoint.config.chunk_bytes):
            nbytes = min(endpoint.config.chunk_bytes, total - offset)
            chunk = KVChunk(room.room, offset, nbytes)
            if not endpoint.send(peer, chunk, view[offset : offset + nbytes], copy=False):
                return
            if room.done:
                return
        if endpoint.send(peer, header, payload) and endpoint.send(peer, RoomDone(room.room, total)):
            endpoint.metrics.bytes_sent += total

    def handle(self, peer: Peer, msg, payload) -> bool:
        """Receiver: a KV chunk for one of `peer`'s rooms; False for other messages."""
        if not isinstance(msg, KVChunk):
            return False
        room = self.endpoint.room_of(peer, msg.room)
        if room is None:
            return True  # late chunk for a finished or foreign room
        data = payload.buffer if payload is not None else None
        problem = room.on_chunk(msg.offset, msg.nbytes, data)
        if problem is not None:
            self.endpoint.fail_room(room, FailureKind.TRANSFER, problem, notify=True)
        else:
            self.endpoint.metrics.bytes_received += msg.nbytes
        return True

    def registration(self, peer: Peer, register: Register) -> Register:
        return register

    def registered(self, peer: Peer, msg: Register) -> None:
        pass

    def forget(self, peer: Peer) -> None:
        pass

    def tick(self, now: float) -> None:
        pass

    def close(self) -> None:
        pass
