"""KV bytes as ZMQ frames on the control connection (the `tcp` backend): the sender announces
each piece of a room (`KVPiece`) and sends its bytes in `KVChunk`s of at most `chunk_bytes`
(zero-copy views, kept alive by the room until it ends); the metadata record and `RoomDone`
follow the last piece. The receiver copies each chunk into the piece's buffer after checking
both against its own reservation. The interface is `data_plane`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.protocol.failures import Failure
from pdserve.protocol.transfer_messages import KVChunk, KVPiece
from pdserve.transfer.data_plane import DataPlane
from pdserve.transfer.kv_piece import OutgoingPiece
from pdserve.transfer.room_state import room_failure

if TYPE_CHECKING:
    from pdserve.transfer.endpoint import Endpoint
    from pdserve.transfer.peer import Peer


class TcpPlane(DataPlane):
    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint

    def send_piece(self, room, piece: OutgoingPiece, index: int) -> bool:
        """Sender (IO thread): announce the piece and send its bytes; False if the peer could
        not take them. The bytes are ready (a GPU piece was staged and waited for)."""
        endpoint, peer = self.endpoint, room.peer
        room.keep(piece.data)  # NOTE: the frames are zero-copy views: kept until the room ends
        total = piece.data.numel()
        if not endpoint.send(peer, piece.announcement(room.room, index)):
            return False
        view = memoryview(piece.data.numpy())
        for offset in range(0, total, endpoint.config.chunk_bytes):
            nbytes = min(endpoint.config.chunk_bytes, total - offset)
            chunk = KVChunk(room.room, index, offset, nbytes)
            if not endpoint.send(peer, chunk, view[offset : offset + nbytes], copy=False):
                return False
            if room.done:
                return False
        endpoint.metrics.bytes_sent += total
        return True

    def handle(self, peer: Peer, msg, payload) -> bool:
        """Receiver: a piece or a chunk for one of `peer`'s rooms; False for other messages."""
        if not isinstance(msg, (KVPiece, KVChunk)):
            return False
        room = self.endpoint.room_of(peer, msg.room)
        if room is None:
            return True  # late bytes for a finished or foreign room
        if isinstance(msg, KVPiece):
            problem = room.on_piece(msg, self.endpoint.buffers.take)
        else:
            data = payload.buffer if payload is not None else None
            problem = self._chunk(room, msg, data)
        if problem is not None:
            self.endpoint.fail_room(room, problem, notify=True)
        return True

    def _chunk(self, room, msg: KVChunk, data: memoryview | None) -> Failure | None:
        """Copy a chunk's bytes into its piece (checked against the room's ledger first)."""
        target = room.chunk_target(msg.piece, msg.offset, msg.nbytes)
        if isinstance(target, Failure):
            return target
        size = len(data) if data is not None else -1
        if size != msg.nbytes:
            return room_failure(
                f"KV chunk of piece {msg.piece} announced {msg.nbytes} bytes, carried {size}"
            )
        target.copy_(torch.frombuffer(data, dtype=torch.uint8))
        room.chunk_landed(msg.piece, msg.nbytes)
        self.endpoint.metrics.bytes_received += msg.nbytes
        return None
