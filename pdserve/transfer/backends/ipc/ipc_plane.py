"""KV written by the prefill worker straight into the decode worker's pages
(`--transfer-backend ipc`: both workers on one host, neither tensor-parallel).

Decode exports its pools once, in `Register` (`shared_pools`); prefill maps them. For each
piece, prefill copies the pages on its compute stream, right behind the chunk that wrote
them, into the page ids decode's transfer request listed (`KVStager.write`: one kernel per
pool over NVLink, no staging buffer, no receive to post) and announces the piece at once
(`KVPiece`, no bytes follow) with a CUDA IPC event recorded after the copy: from the worker's
thread, over the announcement lane decode offered (`ipc_lane`), else over the connection.
Decode checks the piece against its reservation as on every backend and takes the event
(opened at the handshake, `ipc_events`); the piece has landed. The metadata record and
`RoomDone` follow the same way (with the last piece, in one packet); decode's commit has
nothing left to write but to make its stream wait for the events, so no thread of either side
waits for the bytes.

Another process writes decode's pages, so a room that fails cannot always give its pages
back at once: a write may be in flight. Prefill counts each room's writes (a waiter thread
watches each write's event, `staged_sends`): once the room ended here and none is in
flight, none will start, and it says so (`RoomReleased`). Decode
keeps a failed room's pages until then, or until the prefill process is gone
(`IpcReceivePlane.pages_settled`). The handshake checks that both workers share a host and a PID
namespace, and that neither is tensor-parallel.

The interface is `data_plane`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING

import torch

from pdserve.protocol.failures import FailureKind
from pdserve.protocol.transfer_messages import HelloReply, KVPiece, Register, RoomReleased
from pdserve.transfer.backends.ipc.ipc_events import IpcEventRing, OpenedEvents
from pdserve.transfer.backends.ipc.ipc_lane import (
    LaneReceiver,
    LaneSender,
    lane_address_problem,
    lane_fits,
)
from pdserve.transfer.backends.ipc.shared_pools import (
    PoolMapError,
    ProcessWatch,
    export_pool,
    host_id,
    open_pool,
    process_gone,
    remove_counter_files,
)
from pdserve.transfer.config import IPC_TENSOR_PARALLEL
from pdserve.transfer.data_plane import DataPlane
from pdserve.transfer.kv_piece import OutgoingPiece
from pdserve.transfer.room_state import room_failure

if TYPE_CHECKING:
    from pdserve.transfer.endpoint import Endpoint
    from pdserve.transfer.peer import Peer

logger = logging.getLogger(__name__)

OTHER_HOST = (
    "the ipc backend writes KV into the decode worker's memory, so both workers must run on "
    "one host, in one PID namespace: use --transfer-backend nccl or tcp between hosts"
)


class _IpcPlane(DataPlane):
    def __init__(self, endpoint: Endpoint, pools: list[torch.Tensor] | None):
        """pools: this worker's KV pools (their whole storage tensors, target then draft)."""
        if not pools:
            raise ValueError("the ipc backend needs this worker's KV pools")
        self.endpoint = endpoint
        self.pools = pools
        self.host = host_id()


class IpcSendPlane(_IpcPlane):
    """The prefill side: maps each decode peer's pools; announces pieces it wrote."""

    def __init__(self, endpoint: Endpoint, pools: list[torch.Tensor] | None):
        super().__init__(endpoint, pools)
        device = self.pools[0].device
        self.events = IpcEventRing(device) if device.type == "cuda" else None
        self._handles: dict[bytes, tuple[Peer, list]] = {}  # each decode peer's pool handles

    def hello_reply(self, reply: HelloReply) -> HelloReply:
        events = self.events.handles if self.events is not None else []
        return dataclasses.replace(reply, host_id=self.host, pid=os.getpid(), events=events)

    def register_problem(self, peer: Peer, msg: Register) -> str | None:
        """Map the decode worker's pools (kept on the peer); why not, if they cannot be."""
        if msg.host_id != self.host:
            return OTHER_HOST
        if msg.tp_size != 1 or self.endpoint.tp_size != 1:
            return IPC_TENSOR_PARALLEL
        if msg.lane and (problem := lane_address_problem(msg.lane)) is not None:
            return problem
        if len(msg.pools) != len(self.pools):
            return f"decode shares {len(msg.pools)} KV pools, prefill has {len(self.pools)}"
        try:
            peer.pools = [
                open_pool(handle, ours, peer="decode", pid=msg.pid)
                for handle, ours in zip(msg.pools, self.pools, strict=True)
            ]
        except PoolMapError as e:
            return str(e)
        peer.pid, peer.watch = msg.pid, ProcessWatch(msg.pid)
        self._handles[peer.key] = (peer, list(msg.pools))
        if msg.lane:
            try:
                peer.lane = LaneSender(msg.lane, wait_s=self.endpoint.config.peer_timeout_s)
            except OSError as e:  # NOTE: e.g. decode in another network namespace
                logger.info("decode %s: announcements go over the connection: %s", msg.decode_id, e)
        return None

    def send_piece(self, room, piece: OutgoingPiece, index: int) -> bool:
        """Announce a piece whose pages were written (IO thread)."""
        announcement = piece.announcement(room.room, index, piece.event)
        room.keep(piece.ready)  # NOTE: decode opens the event when the announcement arrives
        if not self.endpoint.send(room.peer, announcement):
            return False
        self.endpoint.metrics.bytes_sent += piece.nbytes
        return True

    def tick(self, now: float) -> None:
        """Drop each decode peer whose process exited (its pools die with our mapping) at
        once, not when its silence runs out (a minute, for an idle peer)."""
        endpoint = self.endpoint
        for peer in list(endpoint.peers.values()):
            if peer.pools is not None and peer.watch.gone():
                reason = "exited (its process is gone)" if endpoint.live_rooms(peer) else None
                endpoint.drop_peer(peer, FailureKind.PEER_LOST, reason)

    def forget(self, peer: Peer) -> None:
        """Unmap a decode peer's pools (a CUDA mapping holds the memory of a decode process
        that exited until it is closed); if its process is gone, remove what it left in
        /dev/shm too. NOTE: a write still in flight keeps the mapping alive until it ends
        (`OutgoingPiece.targets`)."""
        peer.pools = None
        owner, handles = self._handles.pop(peer.key, (None, []))
        if owner is peer and peer.watch is not None and peer.watch.gone():
            removed = remove_counter_files(handles, peer.pid)
            if removed:
                logger.info("decode %s exited: removed %s", peer, ", ".join(removed))
        _close_links(peer)

    def close(self) -> None:
        for peer in self.endpoint.peers.values():
            _close_links(peer)


def _close_links(peer: Peer) -> None:
    """A decode peer's lane and process watch. (The worker's thread may still use them: a
    closed lane answers that the connection was dropped, a closed watch asks /proc.)"""
    if peer.lane is not None:
        peer.lane.close()
    if peer.watch is not None:
        peer.watch.close()


class IpcReceivePlane(_IpcPlane):
    """The decode side: shares its pools at registration; takes announcements of pieces
    written into them, and prefill's word that a room's writes are over."""

    def __init__(
        self, endpoint: Endpoint, pools: list[torch.Tensor] | None, metadata_bytes: int = 0
    ):
        """metadata_bytes: the payload of a metadata record (the lane carries it whole)."""
        super().__init__(endpoint, pools)
        self.handles = [export_pool(pool) for pool in pools]
        self.lane = None
        self._read_at: float | None = None  # NOTE: when the lane packet in hand was read
        if lane_fits(metadata_bytes):
            # NOTE: a prefill peer's pid is known from its HelloReply, before it connects.
            wanted = lambda pid: any(p.pid == pid for p in endpoint.peers.values())  # noqa: E731
            limit = 2 * endpoint.config.max_peers  # NOTE: one closing per peer, at most
            self.lane = LaneReceiver(endpoint.io.poller, wanted, limit)

    def hello_problem(self, peer: Peer, msg: HelloReply) -> str | None:
        """Also opens the prefill worker's write events (after it proved the token)."""
        if msg.host_id != self.host or msg.pid <= 0:
            return OTHER_HOST
        if msg.tp_size != 1 or self.endpoint.fanout is not None:
            return IPC_TENSOR_PARALLEL
        problem = self._opened(peer).open_all(msg.events)
        return f"prefill's write events: {problem}" if problem is not None else None

    def registration(self, peer: Peer, register: Register) -> Register:
        lane = self.lane.address if self.lane is not None else ""
        return dataclasses.replace(
            register, host_id=self.host, pid=os.getpid(), pools=list(self.handles), lane=lane
        )

    def on_socket(self, socket) -> bool:
        """The lane's packets, if `socket` is the lane's (True): each from a prefill process
        we registered with, handled as if it came over that peer's connection."""
        if self.lane is None or not self.lane.owns(socket):
            return False
        endpoint = self.endpoint
        self._read_at = time.monotonic()
        try:
            for pid, *received in self.lane.read(socket):
                peer = next(
                    (p for p in endpoint.peers.values() if p.registered and p.pid == pid), None
                )
                if peer is None:
                    problem = f"an announcement from process {pid}, not a prefill peer"
                    endpoint.malformed(None, problem)
                elif len(received) == 1:
                    endpoint.malformed(peer, f"on the announcement lane: {received[0]}")
                else:
                    peer.last_seen = time.monotonic()
                    endpoint.handle_message(peer, *received)
        finally:
            self._read_at = None  # NOTE: a message over a connection has no lane step
        return True

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()

    def pages_settled(self, room) -> bool:
        """The prefill process writes a room's pages until the room succeeded, it said its
        writes are over (`RoomReleased`), or it is gone."""
        pid = room.writer_pid
        return pid is None or room.released or process_gone(pid)

    def _opened(self, peer: Peer) -> OpenedEvents:
        """The events this prefill peer announced (kept while the peer is: `ipc_events`)."""
        if peer.events is None:
            peer.events = OpenedEvents(self.endpoint.device)
        return peer.events

    def handle(self, peer: Peer, msg, payload) -> bool:
        endpoint = self.endpoint
        if isinstance(msg, RoomReleased):
            endpoint.room_released(peer, msg.room)
            return True
        if not isinstance(msg, KVPiece):
            return False
        room = endpoint.room_of(peer, msg.room)
        if room is None:
            return True  # a room that ended: its pages stay held until it is released
        if self._read_at is not None:
            room.stamps.setdefault("lane_read", self._read_at)
        ready = None
        if msg.event:
            ready = self._opened(peer).open(msg.event)
            if isinstance(ready, str):
                failure = room_failure(f"KV piece {msg.index}: {ready}")
                endpoint.fail_room(room, failure, notify=True)
                return True
        problem = room.on_written(msg, ready)
        if problem is not None:
            endpoint.fail_room(room, problem, notify=True)
            return True
        endpoint.metrics.bytes_received += msg.nbytes
        endpoint.room_landed(room)
        return True
