"""The decode side of the `ipc` backend (`ipc_plane` says how it works)."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING

import torch

from pdserve.protocol.transfer_messages import HelloReply, KVPiece, Register, RoomReleased
from pdserve.transfer.backends.ipc.ipc_events import OpenedEvents
from pdserve.transfer.backends.ipc.ipc_lane import LaneReceiver, lane_fits
from pdserve.transfer.backends.ipc.ipc_plane import OTHER_HOST, IpcPlane
from pdserve.transfer.backends.ipc.shared_pools import export_pool, process_gone
from pdserve.transfer.config import IPC_TENSOR_PARALLEL
from pdserve.transfer.room_state import room_failure

if TYPE_CHECKING:
    from pdserve.transfer.endpoint import Endpoint
    from pdserve.transfer.peer import Peer


class IpcReceivePlane(IpcPlane):
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
