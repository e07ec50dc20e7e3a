"""The decode side of KV over torch.distributed (`dist_plane` says how both sides work): it
serves the store its pairs rendezvous on, and posts the receives of each announced piece,
rank 0's here and the other ranks' through them (`rank_fanout`), into scratch for a room that
ended, so that every link's posting order holds."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import uuid
from typing import TYPE_CHECKING

import torch

from pdserve.protocol.failures import Failure, FailureKind
from pdserve.protocol.rank_messages import RankDropSlices, RankReceiveSlices, RankTransferReport
from pdserve.protocol.transfer_messages import KVPiece, Register
from pdserve.transfer.backends.dist.dist_plane import DistPlane
from pdserve.transfer.backends.dist.head_slices import link_parts
from pdserve.transfer.kv_piece import PageSpan
from pdserve.transfer.backends.dist.rank_fanout import RankFanout

if TYPE_CHECKING:
    from pdserve.transfer.endpoint import Endpoint
    from pdserve.transfer.peer import Peer

logger = logging.getLogger(__name__)

# Ended rooms whose reservation we remember, to bound a scratch receive for them.
_ENDED_ROOMS_KEPT = 4096


class DistReceivePlane(DistPlane):
    """The decode side: serves the pairs' store, posts the receives of each announced piece."""

    def __init__(self, endpoint: Endpoint, device: torch.device, fanout: RankFanout | None = None):
        super().__init__(endpoint, device, fanout)
        self._ended: collections.OrderedDict[int, int] = collections.OrderedDict()
        page_bytes = endpoint.page_bytes
        self.head_page_bytes = page_bytes[0] // endpoint.layout.num_kv_heads
        self.draft_page_bytes = page_bytes[1] if len(page_bytes) > 1 else 0

    def registration(self, peer: Peer, register: Register) -> Register:
        """Our store and a new pair group for this peer."""
        endpoint = self.endpoint
        store = self.links.serve_store(endpoint.config.bootstrap_host)
        pair = f"pair/{endpoint.worker_id}/{uuid.uuid4().hex[:12]}"
        self._connect(peer, store, pair, self.tp_size_of(peer), self.tp_size)
        return dataclasses.replace(
            register, store_address=store, pair_name=pair, tp_size=self.tp_size
        )

    def room_ended(self, room) -> None:
        """Remember an ended room's reservation: pieces already on their way still need their
        receives, of at most that size. The other ranks drop its parts unless it committed."""
        self._ended[room.room] = room.expected_bytes
        while len(self._ended) > _ENDED_ROOMS_KEPT:
            self._ended.popitem(last=False)
        if room.has_remote_parts and room.failure is not None:
            # NOTE: every rank of ours is in the plan with any peer (each gets every head it
            # holds), so this needs no state of the room's peer, which may be forgotten.
            for rank in range(1, self.tp_size):
                self.fanout.post(rank, RankDropSlices(room.room))

    def handle(self, peer: Peer, msg, payload) -> bool:
        """Post the piece's receives: into the room's buffers, or into scratch for a room we
        no longer want (each link's order must hold)."""
        if not isinstance(msg, KVPiece):
            return False
        endpoint = self.endpoint
        parts = link_parts(list(self.links_of(peer).slices), self.draft_page_bytes > 0)
        span = PageSpan(msg.first_page, msg.num_pages, msg.first_draft_page, msg.num_draft_pages)
        room = endpoint.room_of(peer, msg.room)
        buffers = None
        if room is not None:
            sizes = self._sizes(parts, span)
            take = functools.partial(endpoint.buffers.take, writer=self.links.stream)
            taken = room.on_parts(msg, parts, sizes, take)
            if isinstance(taken, Failure):
                endpoint.fail_room(room, taken, notify=True)
                room = None
            else:
                buffers = taken
        if buffers is None:
            # NOTE: bounds before allocating: what we reserved for that room, else for any.
            limit = self._ended.get(msg.room, self._scratch_limit())
            counts_ok = min(span.first, span.count, span.draft_first, span.draft_count) >= 0
            page_bytes = endpoint.page_bytes
            if not (
                counts_ok and 0 < msg.nbytes <= limit and msg.nbytes == span.nbytes(page_bytes)
            ):
                logger.error("%s announced %d bytes for room %d", peer, msg.nbytes, msg.room)
                endpoint.drop_peer(peer, FailureKind.TRANSFER, "announced an oversize transfer")
                return True
            sizes = self._sizes(parts, span)
            buffers = {
                part.src: endpoint.buffers.take(size, writer=self.links.stream)
                for part, size in zip(parts, sizes, strict=True)
                if part.dst == 0
            }
        for src, buffer in buffers.items():
            self.links.receive(
                (peer.key, src), buffer, self._landing(peer, room, msg.index, src, buffer)
            )
        self._post_remote(peer, msg, parts, span, scratch=room is None)
        return True

    def _sizes(self, parts, span: PageSpan) -> list[int]:
        return [
            part.nbytes(self.head_page_bytes, self.draft_page_bytes, span.count, span.draft_count)
            for part in parts
        ]

    def _post_remote(self, peer: Peer, msg: KVPiece, parts, span: PageSpan, scratch: bool):
        by_rank: dict[int, list] = {}
        for part in parts:
            if part.dst != 0:
                by_rank.setdefault(part.dst, []).append(part)
        for rank, ours in by_rank.items():
            sizes = self._sizes(ours, span)
            self.fanout.post(
                rank,
                RankReceiveSlices(
                    msg.room,
                    msg.index,
                    scratch,
                    self.links_of(peer).id,
                    [part.src for part in ours],
                    sizes,
                    [part.first_head for part in ours],
                    [part.num_heads for part in ours],
                ),
            )

    def _landing(self, peer: Peer, room, index: int, src: int, buffer: torch.Tensor):
        def done(error: str | None) -> None:
            self.endpoint.io.call(lambda: self._received(peer, room, index, src, buffer, error))

        return done

    def _received(self, peer: Peer, room, index: int, src: int, buffer: torch.Tensor, error):
        endpoint = self.endpoint
        if error is not None:
            # NOTE: the link was torn down, so nothing can still write into the buffer.
            endpoint.buffers.give(buffer)
            endpoint.drop_peer(peer, FailureKind.TRANSFER, error)
            return
        endpoint.metrics.bytes_received += buffer.numel()
        self.bytes_by_link[0, src] += buffer.numel()
        if room is None or room.done:
            endpoint.buffers.give(buffer)  # scratch, or a room that ended meanwhile
            return
        room.on_part_landed(index, src, 0)
        endpoint.room_landed(room)

    def _reported(self, peer: Peer, report: RankTransferReport) -> None:
        if report.kind != "landed":
            return
        self.endpoint.metrics.bytes_received += report.nbytes
        self.bytes_by_link[report.rank, report.peer_rank] += report.nbytes
        room = self.endpoint.room_of(peer, report.room)
        if room is not None:
            room.on_part_landed(report.index, report.peer_rank, report.rank)
            self.endpoint.room_landed(room)

    def _scratch_limit(self) -> int:
        return max((room.expected_bytes for room in self.endpoint.rooms.values()), default=0)
