"""KV bytes over torch.distributed (`nccl`, or `gloo` on CPU) instead of ZMQ frames; the
control messages stay on the ZMQ connection (docs/architecture.md §5).

Point-to-point operations on a pair are matched in posting order, so the order is agreed on
the control connection: the sender sends the metadata record, then announces
`SendReady(room)` once the room's KV is gathered; the receiver posts the receive and answers
`RecvPosted(room)`; the sender sends rooms in the order the answers arrive. Once a receive is
posted its send always happens (the buffer already exists), even if the room was aborted
meanwhile, so a later room can never land in an earlier room's buffer. A send or receive that
misses its deadline tears the link down and fails every room on it. The metadata goes first
so the receiver completes the room as soon as its receive lands, one round trip sooner.

The interface is `tcp_plane`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import TYPE_CHECKING

import torch

from pdserve.protocol.failures import FailureKind
from pdserve.protocol.transfer_messages import RecvPosted, Register, RoomDone, SendReady
from pdserve.transfer.dist_links import DistLinks

if TYPE_CHECKING:
    from pdserve.transfer.endpoint import Endpoint, Peer

logger = logging.getLogger(__name__)


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
                self.endpoint.io.call(
                    lambda: self.endpoint.drop_peer(peer, FailureKind.TRANSFER, error)
                )

        return on_link

    def forget(self, peer: Peer) -> None:
        self.links.forget(peer.key)

    def tick(self, now: float) -> None:
        pass

    def close(self) -> None:
        self.links.close()


class DistSendPlane(_DistPlane):
    """The prefill side: announces gathered rooms, sends each when its receive is posted."""

    def __init__(self, endpoint: Endpoint, device: torch.device):
        super().__init__(endpoint, device)
        # room -> (room, buffer, when announced): kept until its send happened.
        self._announced: dict[int, tuple[object, torch.Tensor, float]] = {}

    @property
    def pending_sends(self) -> int:
        """KV buffers announced to decode whose send has not started yet."""
        return len(self._announced)

    def send(self, room, kv: torch.Tensor, header, payload: bytes) -> None:
        endpoint = self.endpoint
        if endpoint.send(room.peer, header, payload):
            self._announced[room.room] = (room, kv, time.monotonic())
            endpoint.send(room.peer, SendReady(room.room, kv.numel()))
            room.stamps["send_ready_sent"] = time.monotonic()

    def handle(self, peer: Peer, msg, payload) -> bool:
        if not isinstance(msg, RecvPosted):
            return False
        announced = self._announced.pop(msg.room, None)
        if announced is None:
            return True
        room, kv, _ = announced
        room.stamps["recv_posted_seen"] = time.monotonic()
        io = self.endpoint.io
        # NOTE: sent even if the room failed meanwhile: decode's receive is posted.
        self.links.send(
            peer.key, kv, lambda error: io.call(lambda: self._sent(room, kv.numel(), error))
        )
        return True

    def _sent(self, room, total: int, error: str | None) -> None:
        room.stamps["send_done_seen"] = time.monotonic()
        if error is not None:
            self.endpoint.fail_room(room, FailureKind.TRANSFER, error, notify=True)
            return
        self.endpoint.metrics.bytes_sent += total
        if not room.done:  # decode may have acked already (it completes on receipt)
            self.endpoint.send(room.peer, RoomDone(room.room, total))

    def registered(self, peer: Peer, msg: Register) -> None:
        self.links.connect(peer.key, msg.store_address, msg.pair_name, self._link_failed(peer))

    def forget(self, peer: Peer) -> None:
        for room_id, (room, _, _) in list(self._announced.items()):
            if room.peer is peer:
                del self._announced[room_id]
        super().forget(peer)

    def tick(self, now: float) -> None:
        for room, _, announced_at in list(self._announced.values()):
            if now - announced_at > self.endpoint.config.progress_timeout_s and room.peer:
                # NOTE: the pair's order depends on this buffer: drop the whole link.
                reason = "did not post its receive in time"
                self.endpoint.drop_peer(room.peer, FailureKind.TIMEOUT, reason)


class DistReceivePlane(_DistPlane):
    """The decode side: serves the pairs' store, posts a receive per announced room."""

    def registration(self, peer: Peer, register: Register) -> Register:
        """Our store and a new pair group for this peer."""
        endpoint = self.endpoint
        store = self.links.serve_store(endpoint.config.bootstrap_host)
        pair = f"pair/{endpoint.worker_id}/{uuid.uuid4().hex[:12]}"
        self.links.connect(peer.key, store, pair, self._link_failed(peer))
        return dataclasses.replace(register, store_address=store, pair_name=pair)

    def handle(self, peer: Peer, msg, payload) -> bool:
        """Post the receive, then tell prefill to send. A room we no longer want still gets a
        receive, into scratch: the pair's order must hold."""
        if not isinstance(msg, SendReady):
            return False
        endpoint = self.endpoint
        room = endpoint.room_of(peer, msg.room)
        problem = room.expect_receive(msg.nbytes) if room is not None else None
        if problem is not None:
            endpoint.fail_room(room, FailureKind.TRANSFER, problem, notify=True)
            room = None
        # NOTE: bounds before allocating: a live room takes exactly what we reserved; anything
        # else is capped by what our whole reservation could hold.
        if room is None and msg.nbytes > self._scratch_limit():
            logger.error("prefill %s announced %d bytes for room %d", peer, msg.nbytes, msg.room)
            endpoint.drop_peer(peer, FailureKind.TRANSFER, "announced an oversize transfer")
            return True
        if room is not None:
            room.stamps["send_ready_seen"] = time.monotonic()
        buffer = endpoint.buffers.take(msg.nbytes)

        def posted() -> None:
            if room is not None:
                room.stamps["recv_posted"] = time.monotonic()
            endpoint.io.call(lambda: endpoint.send(peer, RecvPosted(msg.room)))

        def done(error: str | None) -> None:
            endpoint.io.call(lambda: self._received(peer, room, buffer, error))

        self.links.receive(peer.key, buffer, posted, done)
        return True

    def _received(self, peer: Peer, room, buffer: torch.Tensor, error: str | None) -> None:
        endpoint = self.endpoint
        if error is not None:
            # NOTE: the link was torn down, so nothing can still write into the buffer.
            endpoint.buffers.give(buffer)
            endpoint.drop_peer(peer, FailureKind.TRANSFER, error)
            return
        if room is None:
            endpoint.buffers.give(buffer)  # scratch receive for a room we had dropped
            return
        room.stamps["recv_done_seen"] = time.monotonic()
        endpoint.metrics.bytes_received += buffer.numel()
        total = room.on_received(buffer)
        if total is not None:
            endpoint.room_done(room, total)

    def _scratch_limit(self) -> int:
        return max((room.expected_bytes for room in self.endpoint.rooms.values()), default=0)
