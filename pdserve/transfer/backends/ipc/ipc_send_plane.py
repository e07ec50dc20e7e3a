"""The prefill side of the `ipc` backend (`ipc_plane` says how it works).

What it knows of its decode peers (each one's pools mapped here, its process and whether it
is alive, the lane its announcements go over) and of its rooms (decode's page ids the pieces
are written into, the writes queued and not completed, whether the room takes more) lives
here, in tables tied to the peer and room objects: a peer's entry goes when it is forgotten,
a room's once the room ended with no write in flight, and all at `close`.

Threads: the prefill worker's thread calls `open_write`, `write_event` and `announce` (and
`carry`, through the server's `send`); everything else runs on the server's IO thread. The
room tables change under the server's lock."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.protocol.failures import Failure, FailureKind
from pdserve.protocol.transfer_messages import HelloReply, Register, RoomReleased, TransferRequest
from pdserve.transfer.backends.ipc.ipc_events import IpcEventRing
from pdserve.transfer.backends.ipc.ipc_lane import LANE_MESSAGES, LaneSender, lane_address_problem
from pdserve.transfer.backends.ipc.ipc_plane import OTHER_HOST, IpcPlane
from pdserve.transfer.backends.ipc.shared_pools import (
    PoolMapError,
    ProcessWatch,
    open_pool,
    remove_counter_files,
)
from pdserve.transfer.config import IPC_TENSOR_PARALLEL
from pdserve.transfer.kv_piece import OutgoingPiece, PageSpan
from pdserve.transfer.page_ids import unpack_page_ids
from pdserve.transfer.room_state import room_failure

if TYPE_CHECKING:
    from pdserve.transfer.peer import Peer
    from pdserve.transfer.prefill_side import PrefillTransferServer
    from pdserve.transfer.sender_room import SenderRoom

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class DecodeProcess:
    """One registered decode peer as the prefill side of `ipc` knows it from its `Register`."""

    peer: Peer
    pools: list[torch.Tensor]  # its pools, mapped into this process
    handles: list  # the handles they were mapped from (what `forget` cleans up after)
    pid: int
    watch: ProcessWatch  # whether its process is alive: it must be while we write
    lane: LaneSender | None  # where announcements go (`ipc_lane`); None: over the connection


@dataclasses.dataclass
class RoomWrites:
    """A room's writes into decode's pages (under the server's lock)."""

    pages: list[int]  # decode's page ids (target pool), from its transfer request
    draft_pages: list[int]  # and the draft pool's
    in_flight: int = 0  # queued and not completed
    closed: bool = False  # the room ended: it takes no more

    def open(self) -> bool:
        if self.closed:
            return False
        self.in_flight += 1
        return True

    def ended(self) -> bool:
        """A write completed or was not queued; True if the room ended and this was its last."""
        self.in_flight -= 1
        return self.closed and self.in_flight == 0

    def close(self) -> bool:
        """True if no write is in flight."""
        self.closed = True
        return self.in_flight == 0


class IpcSendPlane(IpcPlane):
    """The prefill side: maps each decode peer's pools; announces pieces written there."""

    def __init__(self, endpoint: PrefillTransferServer, pools: list[torch.Tensor] | None):
        super().__init__(endpoint, pools)
        device = self.pools[0].device
        self.events = IpcEventRing(device) if device.type == "cuda" else None
        self.decodes: dict[bytes, DecodeProcess] = {}  # by peer key, while the peer is
        self.writes: dict[SenderRoom, RoomWrites] = {}  # rooms attached to a peer
        # Rooms that failed with writes in flight, by id: decode hears `RoomReleased` once
        # the last one completed.
        self.unreleased: dict[int, SenderRoom] = {}

    # ---- peers -----------------------------------------------------------------------

    def hello_reply(self, reply: HelloReply) -> HelloReply:
        events = self.events.handles if self.events is not None else []
        return dataclasses.replace(reply, host_id=self.host, pid=os.getpid(), events=events)

    def register_problem(self, peer: Peer, msg: Register) -> str | None:
        """Map the decode worker's pools; why not, if they cannot be."""
        if msg.host_id != self.host:
            return OTHER_HOST
        if msg.tp_size != 1 or self.endpoint.tp_size != 1:
            return IPC_TENSOR_PARALLEL
        if msg.lane and (problem := lane_address_problem(msg.lane)) is not None:
            return problem
        if len(msg.pools) != len(self.pools):
            return f"decode shares {len(msg.pools)} KV pools, prefill has {len(self.pools)}"
        try:
            pools = [
                open_pool(handle, ours, peer="decode", pid=msg.pid)
                for handle, ours in zip(msg.pools, self.pools, strict=True)
            ]
        except PoolMapError as e:
            return str(e)
        lane = None
        if msg.lane:
            try:
                lane = LaneSender(msg.lane, wait_s=self.endpoint.config.peer_timeout_s)
            except OSError as e:  # NOTE: e.g. decode in another network namespace
                logger.info("decode %s: announcements go over the connection: %s", msg.decode_id, e)
        old = self.decodes.get(peer.key)
        if old is not None:
            _close_links(old)
        watch = ProcessWatch(msg.pid)
        self.decodes[peer.key] = DecodeProcess(peer, pools, list(msg.pools), msg.pid, watch, lane)
        return None

    def decode_of(self, peer: Peer | None) -> DecodeProcess | None:
        """What we know of this decode peer (not of an earlier one at its address)."""
        known = self.decodes.get(peer.key) if peer is not None else None
        return known if known is not None and known.peer is peer else None

    def tick(self, now: float) -> None:
        """Drop each decode peer whose process exited (its pools die with our mapping) at
        once, not when its silence runs out (a minute, for an idle peer)."""
        endpoint = self.endpoint
        for known in list(self.decodes.values()):
            peer = known.peer
            if known.watch.gone():
                reason = "exited (its process is gone)" if endpoint.live_rooms(peer) else None
                endpoint.drop_peer(peer, FailureKind.PEER_LOST, reason)

    def forget(self, peer: Peer) -> None:
        """Unmap a decode peer's pools (a CUDA mapping holds the memory of a decode process
        that exited until it is closed); if its process is gone, remove what it left in
        /dev/shm too. NOTE: a write still in flight keeps the mapping alive until it ends
        (`OutgoingPiece.targets`)."""
        known = self.decode_of(peer)
        if known is None:
            return
        del self.decodes[peer.key]
        if known.watch.gone():
            removed = remove_counter_files(known.handles, known.pid)
            if removed:
                logger.info("decode %s exited: removed %s", peer, ", ".join(removed))
        _close_links(known)

    def close(self) -> None:
        for known in self.decodes.values():
            _close_links(known)
        self.decodes.clear()
        self.writes.clear()
        self.unreleased.clear()

    # ---- rooms (IO thread) -----------------------------------------------------------

    def accept_pages(self, peer: Peer, msg: TransferRequest) -> RoomWrites | Failure:
        """The page ids decode asked us to write, or what is wrong with them (checked
        against decode's pools as mapped)."""
        known = self.decode_of(peer)
        if known is None:
            return room_failure("decode's pools are not mapped here (it registered again?)")
        pools = known.pools
        if len(pools) == 1 and (msg.num_draft_pages or msg.draft_page_ids):
            return room_failure(
                "decode's transfer request asks for draft pages; it shared no draft KV pool"
            )
        lists = [[], []]
        wire = ((msg.page_ids, msg.num_pages), (msg.draft_page_ids, msg.num_draft_pages))
        for i, ((data, count), pool) in enumerate(zip(wire, pools, strict=False)):
            ids = unpack_page_ids(data, count, pool.shape[2])
            if isinstance(ids, str):
                return room_failure(f"decode's transfer request: {ids}")
            lists[i] = ids
        return RoomWrites(lists[0], lists[1])

    def room_attached(self, room: SenderRoom, accepted: RoomWrites) -> None:
        with self.endpoint.lock:
            self.writes[room] = accepted

    def room_ended(self, room: SenderRoom) -> None:
        """The room takes no more writes; a failed one's decode hears `RoomReleased` once
        none is in flight (a room decode has whole is its engine's at once)."""
        with self.endpoint.lock:
            writes = self.writes.get(room)
            settled = writes is None or writes.close()
            if settled:
                self.writes.pop(room, None)
        if room.failure is None:
            return
        if settled:
            self._released(room)
        else:
            self.unreleased[room.room] = room

    def release_if_settled(self, peer: Peer, room_id: int) -> None:
        """Tell decode a room it asked about is over here with no write in flight, unless a
        live room or a write still in flight says otherwise."""
        if room_id in self.unreleased:
            return
        room = self.endpoint.rooms.get(room_id)
        if room is None:
            self.endpoint.send(peer, RoomReleased(room_id))
            return
        with self.endpoint.lock:
            writes = self.writes.get(room)
            ended = writes.closed if writes is not None else room.done
        if ended:
            self.endpoint.send(peer, RoomReleased(room_id))

    def written(self, room: SenderRoom, piece: OutgoingPiece) -> None:
        """A write into decode's pages completed (`piece` kept decode's pools mapped until
        now). If the room ended meanwhile and this was its last write, tell decode its pages
        are free."""
        self._write_ended(room)

    def write_failed(self, room: SenderRoom, failure: Failure) -> None:
        """A write given a destination was not queued (nothing of it runs): the room fails."""
        self.endpoint.fail_room(room, failure, notify=True)
        self._write_ended(room)

    def _write_ended(self, room: SenderRoom) -> None:
        with self.endpoint.lock:
            writes = self.writes.get(room)
            settled = writes is not None and writes.ended()
            if settled:
                del self.writes[room]
        if settled and self.unreleased.pop(room.room, None) is not None:
            self._released(room)

    def _released(self, room: SenderRoom) -> None:
        peer = room.peer
        if peer is not None and self.endpoint.peers.get(peer.key) is peer:
            self.endpoint.send(peer, RoomReleased(room.room))

    # ---- writes (the worker's thread) ------------------------------------------------

    def open_write(self, room: SenderRoom, span: PageSpan) -> tuple[list, list[list[int]]] | None:
        """Before writing a piece into decode's pages: where to, or None if the room takes
        no more writes; counts the write as in flight.

        NOTE: a decode process that exited freed its pools, and writing memory its owner
        freed is undefined behaviour for the writer's GPU context, so each write first checks
        that decode is alive (a peer found gone is dropped at once, without waiting for its
        silence): what is left is a decode dying while a copy runs."""
        endpoint = self.endpoint
        peer = room.peer
        # NOTE: read once: the IO thread's `forget` may drop the entry at any moment.
        known = self.decode_of(peer)
        if known is not None and known.watch.gone():
            error = "exited (its process is gone)"
            endpoint.io.call(lambda: endpoint.drop_peer(peer, FailureKind.PEER_LOST, error))
            return None
        if known is None:
            return None
        with endpoint.lock:
            writes = self.writes.get(room)
            if writes is None or room.peer is not peer or not writes.open():
                return None
        pools = list(known.pools)
        return pools, span.page_lists(writes.pages, writes.draft_pages, len(pools))

    def write_event(self) -> tuple[torch.cuda.Event | None, bytes]:
        """An event after the writes queued so far on the current stream, and its
        interprocess handle (`ipc_events`); (None, b"") on the CPU."""
        return self.events.record() if self.events is not None else (None, b"")

    def announce(self, room: SenderRoom, *steps: Callable[[], None]) -> None:
        """Run a room's send steps (the server's `send_piece`, `finish_room`) right here
        when its peer has a lane, which `carry` then takes, their messages in one packet
        where they fit; else on the IO thread."""
        known = self.decode_of(room.peer)
        lane = known.lane if known is not None else None
        if lane is None:
            self.endpoint.io.call(lambda: _run(steps))
            return
        lane.hold()
        try:
            _run(steps)
        finally:
            problem = lane.flush()
        if problem is not None:
            self.endpoint.fail_on_io_thread(room, room_failure(problem, FailureKind.PEER_LOST))

    def announce_step(self, room: SenderRoom, step: Callable[[], None]) -> bool:
        """A step with no piece (`finish`): after the announcements, the same way."""
        self.announce(room, step)
        return True

    def written_piece(self, room: SenderRoom, piece: OutgoingPiece, steps: list) -> None:
        """A piece written into decode's pages already: announced at once (decode's work on
        the pages waits for the write's event on the GPU); the write counts as in flight
        until that event is seen complete."""
        endpoint = self.endpoint
        self.announce(room, *steps)
        endpoint.submit(room, lambda: self.written(room, piece), piece.ready)

    def carry(self, peer: Peer, msg, payload: tuple) -> bool | None:
        """Send what a decode peer's lane carries (`ipc_lane`), from whichever thread
        announces; None: not the lane's to carry. A room whose announcement could not go
        fails."""
        known = self.decode_of(peer)
        lane = known.lane if known is not None else None
        if lane is None or not isinstance(msg, LANE_MESSAGES):
            return None
        problem = lane.send(msg, *payload)
        room = self.endpoint.rooms.get(msg.room)
        if problem is not None and room is not None:
            self.endpoint.fail_on_io_thread(room, room_failure(problem, FailureKind.PEER_LOST))
        return problem is None

    # ---- pieces (IO thread) ----------------------------------------------------------

    def send_piece(self, room, piece: OutgoingPiece, index: int) -> bool:
        """Announce a piece whose pages were written."""
        announcement = piece.announcement(room.room, index, piece.event)
        room.keep(piece.ready)  # NOTE: decode opens the event when the announcement arrives
        if not self.endpoint.send(room.peer, announcement):
            return False
        self.endpoint.metrics.bytes_sent += piece.nbytes
        return True


def _run(steps) -> None:
    for step in steps:
        step()


def _close_links(known: DecodeProcess) -> None:
    """A decode peer's lane and process watch. (The worker's thread may still use them: a
    closed lane answers that the connection was dropped, a closed watch asks /proc.)"""
    if known.lane is not None:
        known.lane.close()
    known.watch.close()
