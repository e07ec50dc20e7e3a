"""The decode side of the `ipc` backend (`ipc_plane` says how it works).

What it knows of its prefill peers (each one's process and the write events it announced)
and of its rooms (which prefill process may write a room's pages, and whether that process
said its writes are over) lives here, in tables tied to the peer and room objects: an entry
goes when its peer is forgotten or its room is (`room_forgotten`), and all at `close`."""

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
    from pdserve.transfer.receiver_room import ReceiverRoom


@dataclasses.dataclass
class PrefillProcess:
    """One prefill peer as the decode side of `ipc` knows it from its `HelloReply`."""

    peer: Peer
    pid: int  # its process (see `shared_pools.process_gone`)
    events: OpenedEvents  # its write events we opened (`ipc_events`)


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
        self.prefills: dict[object, PrefillProcess] = {}  # by peer key, while the peer is
        # Under the endpoint's lock: the prefill process each room's transfer request went
        # to, which may write its pages, and the rooms whose writer said its writes are over.
        self.writers: dict[ReceiverRoom, int] = {}
        self.released: set[ReceiverRoom] = set()
        if lane_fits(metadata_bytes):
            # NOTE: a prefill peer's pid is known from its HelloReply, before it connects.
            wanted = lambda pid: any(p.pid == pid for p in self.prefills.values())  # noqa: E731
            limit = 2 * endpoint.config.max_peers  # NOTE: one closing per peer, at most
            self.lane = LaneReceiver(endpoint.io.poller, wanted, limit)

    def hello_problem(self, peer: Peer, msg: HelloReply) -> str | None:
        """Also opens the prefill worker's write events (after it proved the token)."""
        if msg.host_id != self.host or msg.pid <= 0:
            return OTHER_HOST
        if msg.tp_size != 1 or self.endpoint.fanout is not None:
            return IPC_TENSOR_PARALLEL
        known = self._prefill(peer)
        events = known.events if known is not None else OpenedEvents(self.endpoint.device)
        problem = events.open_all(msg.events)
        if problem is not None:
            return f"prefill's write events: {problem}"
        self.prefills[peer.key] = PrefillProcess(peer, msg.pid, events)
        return None

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
                    (p.peer for p in self.prefills.values() if p.peer.registered and p.pid == pid),
                    None,
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
        self.prefills.clear()
        self.writers.clear()
        self.released.clear()

    def forget(self, peer: Peer) -> None:
        if self._prefill(peer) is not None:
            del self.prefills[peer.key]

    def pages_settled(self, room) -> bool:
        """The prefill process writes a room's pages until the room succeeded, it said its
        writes are over (`RoomReleased`), or it is gone."""
        pid = self.writers.get(room)
        return pid is None or room in self.released or process_gone(pid)

    def admit_request(self, peer: Peer, room) -> bool:
        """The prefill process behind `peer` may write the room's pages from now on; none may
        once the room ended (its pages may be free already) or was forgotten."""
        prefill = self._prefill(peer)
        if room is None or room.done or prefill is None:
            return False
        self.writers[room] = prefill.pid
        return True

    def writes_pending(self, room, by: Peer | None = None) -> bool:
        pid = self.writers.get(room)
        if pid is None or room in self.released:
            return False
        return by is None or self._pid_of(by) == pid

    def writes_released(self, peer: Peer, room) -> bool:
        """Taken from the room's writer only: a process that may write a room's pages
        answers for it on whatever connection it has (one of a lost connection's rooms)."""
        pid = self.writers.get(room)
        if pid is None or self._pid_of(peer) != pid:
            return False
        self.released.add(room)
        return True

    def room_forgotten(self, room) -> None:
        self.writers.pop(room, None)
        self.released.discard(room)

    def _prefill(self, peer: Peer) -> PrefillProcess | None:
        """What we know of this prefill peer (not of an earlier one at its address)."""
        prefill = self.prefills.get(peer.key)
        return prefill if prefill is not None and prefill.peer is peer else None

    def _pid_of(self, peer: Peer) -> int | None:
        prefill = self._prefill(peer)
        return prefill.pid if prefill is not None else None

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
            prefill = self._prefill(peer)
            ready = prefill.events.open(msg.event) if prefill else "from an unknown prefill peer"
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
