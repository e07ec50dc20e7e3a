"""KV bytes over torch.distributed (`nccl`, or `gloo` on CPU) instead of ZMQ frames; the
control messages stay on the ZMQ connection (docs/architecture.md §5).

Point-to-point operations on a pair are matched in posting order, and the control connection
fixes that order: the sender announces each piece (`KVPiece`) and posts its send at once, in
the same step on its IO thread; the receiver posts the matching receive when the announcement
arrives (NCCL holds the send until then), so no round trip precedes a send and any number of
pieces and rooms are in flight on a pair. Every announced piece gets its receive, into scratch
if the room is gone (bounded by what we reserved), so a later piece never lands in an earlier
one's buffer. A send or receive that misses its deadline, or fails, tears the link down and
drops the peer with its rooms. The metadata record and `RoomDone` follow the last piece's
announcement without waiting for its bytes: the room completes when everything has landed.

The interface is `tcp_plane`'s.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import uuid
from typing import TYPE_CHECKING

import torch

from pdserve.protocol.failures import FailureKind
from pdserve.protocol.transfer_messages import KVPiece, Register
from pdserve.transfer.dist_links import DistLinks
from pdserve.transfer.kv_piece import OutgoingPiece

if TYPE_CHECKING:
    from pdserve.transfer.endpoint import Endpoint, Peer

logger = logging.getLogger(__name__)

# Ended rooms whose reservation we remember, to bound a scratch receive for them.
_ENDED_ROOMS_KEPT = 4096


def _links(endpoint: Endpoint, device: torch.device) -> DistLinks:
    config = endpoint.config
    return DistLinks(
        config.backend, endpoint.side, config.progress_timeout_s, device, config.bootstrap_host
    )


class _DistPlane:
    def __init__(self, endpoint: Endpoint, device: torch.device):
        self.endpoint = endpoint
        self.links = _links(endpoint, device)

    def _link_failed(self, peer: Peer):
        def on_link(error: str | None) -> None:
            if error:
                self._drop(peer, error)

        return on_link

    def _drop(self, peer: Peer, error: str) -> None:
        self.endpoint.io.call(lambda: self.endpoint.drop_peer(peer, FailureKind.TRANSFER, error))

    def forget(self, peer: Peer) -> None:
        self.links.forget(peer.key)

    def tick(self, now: float) -> None:
        pass

    def close(self) -> None:
        self.links.close()


class DistSendPlane(_DistPlane):
    """The prefill side: announces each piece and posts its send."""

    def __init__(self, endpoint: Endpoint, device: torch.device):
        super().__init__(endpoint, device)
        self.pending_sends = 0  # sends posted and not completed

    def send_piece(self, room, piece: OutgoingPiece, index: int) -> bool:
        """Announce and post one piece (IO thread); False if the peer could not take it."""
        span, nbytes = piece.span, piece.data.numel()
        announcement = KVPiece(
            room.room, index, span.first, span.count, span.draft_first, span.draft_count, nbytes
        )
        peer = room.peer
        if not self.endpoint.send(peer, announcement):
            return False
        self.pending_sends += 1
        self.links.send(
            peer.key,
            piece.data,
            piece.ready,
            lambda error: self.endpoint.io.call(lambda: self._sent(peer, nbytes, error)),
        )
        return True

    def _sent(self, peer: Peer, nbytes: int, error: str | None) -> None:
        self.pending_sends -= 1
        if error is not None:
            self.endpoint.drop_peer(peer, FailureKind.TRANSFER, error)
            return
        self.endpoint.metrics.bytes_sent += nbytes

    def handle(self, peer: Peer, msg, payload) -> bool:
        return False

    def registered(self, peer: Peer, msg: Register) -> None:
        self.links.connect(peer.key, msg.store_address, msg.pair_name, self._link_failed(peer))


class DistReceivePlane(_DistPlane):
    """The decode side: serves the pairs' store, posts a receive per announced piece."""

    def __init__(self, endpoint: Endpoint, device: torch.device):
        super().__init__(endpoint, device)
        self._ended: collections.OrderedDict[int, int] = collections.OrderedDict()

    def registration(self, peer: Peer, register: Register) -> Register:
        """Our store and a new pair group for this peer."""
        endpoint = self.endpoint
        store = self.links.serve_store(endpoint.config.bootstrap_host)
        pair = f"pair/{endpoint.worker_id}/{uuid.uuid4().hex[:12]}"
        self.links.connect(peer.key, store, pair, self._link_failed(peer))
        return dataclasses.replace(register, store_address=store, pair_name=pair)

    def room_ended(self, room) -> None:
        """Remember an ended room's reservation: pieces already on their way still need a
        receive, of at most that size."""
        self._ended[room.room] = room.expected_bytes
        while len(self._ended) > _ENDED_ROOMS_KEPT:
            self._ended.popitem(last=False)

    def handle(self, peer: Peer, msg, payload) -> bool:
        """Post the piece's receive: into the room's buffer, or into scratch for a room we no
        longer want (the pair's order must hold)."""
        if not isinstance(msg, KVPiece):
            return False
        endpoint = self.endpoint
        room = endpoint.room_of(peer, msg.room)
        buffer = None
        if room is not None:
            taken = room.on_piece(msg, posting=True, writer=self.links.stream)
            if isinstance(taken, str):
                endpoint.fail_room(room, FailureKind.TRANSFER, taken, notify=True)
                room = None
            else:
                buffer = taken
        if buffer is None:
            # NOTE: bounds before allocating: what we reserved for that room, else for any.
            limit = self._ended.get(msg.room, self._scratch_limit())
            if not 0 < msg.nbytes <= limit:
                logger.error("%s announced %d bytes for room %d", peer, msg.nbytes, msg.room)
                endpoint.drop_peer(peer, FailureKind.TRANSFER, "announced an oversize transfer")
                return True
            buffer = endpoint.buffers.take(msg.nbytes, writer=self.links.stream)

        def done(error: str | None) -> None:
            endpoint.io.call(lambda: self._received(peer, room, msg.index, buffer, error))

        self.links.receive(peer.key, buffer, done)
        return True

    def _received(self, peer: Peer, room, index: int, buffer: torch.Tensor, error) -> None:
        endpoint = self.endpoint
        if error is not None:
            # NOTE: the link was torn down, so nothing can still write into the buffer.
            endpoint.buffers.give(buffer)
            endpoint.drop_peer(peer, FailureKind.TRANSFER, error)
            return
        endpoint.metrics.bytes_received += buffer.numel()
        if room is None or room.done:
            endpoint.buffers.give(buffer)  # scratch, or a room that ended meanwhile
            return
        room.on_landed(index, buffer.numel())
        endpoint.room_landed(room)

    def _scratch_limit(self) -> int:
        return max((room.expected_bytes for room in self.endpoint.rooms.values()), default=0)
