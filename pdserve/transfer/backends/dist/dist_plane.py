"""KV bytes over torch.distributed (`nccl`, or `gloo` on CPU) instead of ZMQ frames; the
control messages stay on the ZMQ connection (docs/architecture/data-plane.md).

Point-to-point operations on a pair are matched in posting order, and the control connection
fixes that order: the sender announces each piece (`KVPiece`) and posts its sends at once, in
the same step on its IO thread; the receiver posts the matching receives when the announcement
arrives (NCCL holds a send until then), so no round trip precedes a send and any number of
pieces and rooms are in flight on a pair. Every announced piece gets its receives, into scratch
if the room is gone (bounded by what we reserved), so a later piece never lands in an earlier
one's buffer. A send or receive that misses its deadline, or fails, tears the link down and
drops the peer with its rooms. The metadata record and `RoomDone` follow the last piece's
announcement without waiting for its bytes: the room completes when everything has landed.

Each rank of one worker has its own link to each rank of the peer it exchanges KV heads with
(`head_slices`), so a piece travels as one part per such pair; between two workers without
tensor parallelism that is one link and one transfer per piece. Rank 0 posts its own parts;
the other ranks post theirs when rank 0 tells them (`rank_fanout`): on a prefill worker right
after gathering them, in order with the passes, so the piece must then be announced even if its
room ended meanwhile; on a decode worker when the announcement arrives. They report each
part's end back, and a piece has landed when all its parts have.

What the plane knows of each peer (its TP size from the handshake, its links) lives in the
plane's own table, not on the peer: the endpoint's `Peer` knows nothing of torch.distributed.

The interface is `data_plane`'s; the decode side's plane is `dist_receive_plane`'s.
"""

from __future__ import annotations

import collections
import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import zmq

from pdserve.protocol.failures import FailureKind
from pdserve.protocol.rank_messages import (
    RankLinkConnect,
    RankLinkForget,
    RankTransferReport,
)
from pdserve.protocol.transfer_messages import HelloReply, Register
from pdserve.transfer.data_plane import DataPlane
from pdserve.transfer.backends.dist.dist_links import DistLinks
from pdserve.transfer.backends.dist.head_slices import PeerLinks, head_slices, tp_mismatch
from pdserve.transfer.kv_piece import OutgoingPiece
from pdserve.transfer.backends.dist.rank_fanout import RankFanout

if TYPE_CHECKING:
    from pdserve.transfer.endpoint import Endpoint
    from pdserve.transfer.peer import Peer

logger = logging.getLogger(__name__)


def _links(endpoint: Endpoint, device: torch.device) -> DistLinks:
    config = endpoint.config
    return DistLinks(
        config.backend, endpoint.side, config.progress_timeout_s, device, config.bootstrap_host
    )


@dataclass
class _PeerState:
    """What the plane knows of one peer object (a new connection under the same key is a new
    peer, with a state of its own): its TP size from the handshake, its links once made."""

    peer: Peer
    tp_size: int
    links: PeerLinks | None = None


class DistPlane(DataPlane):
    """What both sides' planes share: the links, the plan per peer, the ranks' reports."""

    def __init__(self, endpoint: Endpoint, device: torch.device, fanout: RankFanout | None):
        self.endpoint = endpoint
        self.links = _links(endpoint, device)
        self.fanout = fanout
        self.tp_size = fanout.tp_size if fanout is not None else 1
        self._link_ids = itertools.count()
        self._states: dict[Any, _PeerState] = {}  # by peer key
        self._peers: dict[int, Peer] = {}  # by links id: whom a rank's report is about
        # KV bytes moved, by (our rank, the peer's rank): which links carried the KV.
        self.bytes_by_link: collections.Counter[tuple[int, int]] = collections.Counter()

    def links_of(self, peer: Peer) -> PeerLinks | None:
        """The peer's links, None before they are made or once it was forgotten."""
        state = self._state(peer)
        return state.links if state is not None else None

    def tp_size_of(self, peer: Peer) -> int | None:
        """The peer's tensor-parallel size from its handshake, None if not seen yet."""
        state = self._state(peer)
        return state.tp_size if state is not None else None

    def _state(self, peer: Peer) -> _PeerState | None:
        state = self._states.get(peer.key)
        return state if state is not None and state.peer is peer else None

    def _shook_hands(self, peer: Peer, tp_size: int) -> None:
        """Start the peer's state; an older peer's still under its key goes, links and all."""
        stale = self._states.get(peer.key)
        if stale is not None:
            self.forget(stale.peer)
        self._states[peer.key] = _PeerState(peer, tp_size)

    def _connect(self, peer: Peer, store: str, pair: str, prefill_tp: int, decode_tp: int):
        """Make every link of ours to the peer's ranks: rank 0's here, the other ranks' by
        telling them."""
        slices = head_slices(self.endpoint.layout.num_kv_heads, prefill_tp, decode_tp)
        links = PeerLinks(next(self._link_ids), tuple(slices))
        state = self._state(peer)
        if state.links is not None:
            self._peers.pop(state.links.id, None)
        state.links = links
        self._peers[links.id] = peer
        ours, theirs = ("src", "dst") if self.endpoint.side == "prefill" else ("dst", "src")
        for piece_slice in slices:
            rank, peer_rank = getattr(piece_slice, ours), getattr(piece_slice, theirs)
            name = links.pair_name(pair, piece_slice.src, piece_slice.dst)
            if rank == 0:
                self.links.connect((peer.key, peer_rank), store, name, self._link_failed(peer))
            else:
                self.fanout.post(rank, RankLinkConnect(links.id, peer_rank, store, name))

    def _our_ranks(self, links: PeerLinks) -> set[tuple[int, int]]:
        """(our rank, the peer's rank) of every link to the peer."""
        prefill = self.endpoint.side == "prefill"
        return {(s.src, s.dst) if prefill else (s.dst, s.src) for s in links.slices}

    def _link_failed(self, peer: Peer):
        def on_link(error: str | None) -> None:
            if error:
                self._drop(peer, error)

        return on_link

    def _drop(self, peer: Peer, error: str) -> None:
        self.endpoint.io.call(lambda: self.endpoint.drop_peer(peer, FailureKind.TRANSFER, error))

    def forget(self, peer: Peer) -> None:
        """Drop the peer's state and its links, ours and the other ranks'."""
        state = self._state(peer)
        if state is None:
            return
        del self._states[peer.key]
        links = state.links
        if links is None:
            return
        self._peers.pop(links.id, None)
        ranks = self._our_ranks(links)
        for rank, peer_rank in ranks:
            if rank == 0:
                self.links.forget((peer.key, peer_rank))
        for rank in sorted({rank for rank, _ in ranks} - {0}):
            self.fanout.post(rank, RankLinkForget(links.id))

    def hello_problem(self, peer: Peer, msg: HelloReply) -> str | None:
        """Decode: a prefill worker whose ranks cannot split our KV heads; else its TP size
        is the peer's."""
        problem = tp_mismatch(self.endpoint.layout.num_kv_heads, msg.tp_size, "prefill")
        if problem is None:
            self._shook_hands(peer, msg.tp_size)
        return problem

    def register_problem(self, peer: Peer, msg: Register) -> str | None:
        """Prefill: a decode worker whose ranks cannot split our KV heads."""
        return tp_mismatch(self.endpoint.layout.num_kv_heads, msg.tp_size, "decode")

    def on_reports(self) -> None:
        """Drain what the other ranks reported (IO thread)."""
        while (report := self._next_report()) is not None:
            peer = self._peers.get(report.link)
            if peer is None or self.endpoint.peers.get(peer.key) is not peer:
                continue  # a peer dropped meanwhile
            if report.error is not None:
                error = f"rank {report.rank}'s {self.links.backend} link failed: {report.error}"
                self.endpoint.drop_peer(peer, FailureKind.TRANSFER, error)
                continue
            self._reported(peer, report)

    def _next_report(self) -> RankTransferReport | None:
        try:
            return self.fanout.reports.receive(zmq.NOBLOCK).msg
        except zmq.Again:
            return None

    def _reported(self, peer: Peer, report: RankTransferReport) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.links.close()
        if self.fanout is not None:
            self.fanout.close()


class DistSendPlane(DistPlane):
    """The prefill side: announces each piece and posts its sends."""

    def __init__(self, endpoint: Endpoint, device: torch.device, fanout: RankFanout | None = None):
        super().__init__(endpoint, device, fanout)
        # Sends posted and not completed, by the peer's links id. NOTE: per peer, so that a
        # peer dropped with sends whose end never comes (its link was never created, or a
        # rank's report is skipped) takes them with it.
        self._pending: collections.Counter[int] = collections.Counter()

    @property
    def pending_sends(self) -> int:
        """Sends posted and not completed."""
        return sum(self._pending.values())

    def send_piece(self, room, piece: OutgoingPiece, index: int) -> bool:
        """Announce one piece and post rank 0's parts (IO thread); False if the peer could
        not take it."""
        peer = room.peer
        if not self.endpoint.send(peer, piece.announcement(room.room, index)):
            return False
        sends = piece.sends if piece.data is None else [(0, piece.data)]
        self._pending[self.links_of(peer).id] += piece.remote + len(sends)
        for dst, data in sends:
            nbytes = data.numel()
            self.links.send(
                (peer.key, dst),
                data,
                piece.ready,
                lambda error, d=dst, n=nbytes: self.endpoint.io.call(
                    lambda: self._sent(peer, d, n, error)
                ),
            )
        return True

    def forget(self, peer: Peer) -> None:
        links = self.links_of(peer)
        if links is not None:
            self._pending.pop(links.id, None)
        super().forget(peer)

    def _ended(self, peer: Peer) -> None:
        """One of the peer's sends ended (nothing if the peer was dropped meanwhile)."""
        key = self.links_of(peer).id
        if self._pending[key] > 1:
            self._pending[key] -= 1
        else:
            self._pending.pop(key, None)

    def _sent(self, peer: Peer, dst: int, nbytes: int, error: str | None) -> None:
        if self.endpoint.peers.get(peer.key) is not peer:
            return  # dropped meanwhile: its sends were forgotten with it
        self._ended(peer)
        if error is not None:
            self.endpoint.drop_peer(peer, FailureKind.TRANSFER, error)
            return
        self.endpoint.metrics.bytes_sent += nbytes
        self.bytes_by_link[0, dst] += nbytes

    def _reported(self, peer: Peer, report: RankTransferReport) -> None:
        if report.kind == "sent":
            self._ended(peer)
            self.endpoint.metrics.bytes_sent += report.nbytes
            self.bytes_by_link[report.rank, report.peer_rank] += report.nbytes

    def registered(self, peer: Peer, msg: Register) -> None:
        self._shook_hands(peer, msg.tp_size)
        self._connect(peer, msg.store_address, msg.pair_name, self.tp_size, msg.tp_size)
