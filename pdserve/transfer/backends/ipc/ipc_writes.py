"""The prefill side's half of the `ipc` backend (`ipc_plane` says how it works): the page ids
decode asked us to write, announcing the pieces written (over `ipc_lane` from the worker's
thread, else on the IO thread), each room's writes in flight, and telling decode when a room
that ended has none left (`RoomReleased`). A mixin of PrefillTransferServer; the worker's
thread calls `open_write` and `announce` (and `send`, through it), everything else runs on
the IO thread."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.protocol.failures import Failure, FailureKind
from pdserve.protocol.transfer_messages import RoomReleased, TransferRequest
from pdserve.transfer.backends.ipc.ipc_lane import LANE_MESSAGES
from pdserve.transfer.kv_piece import OutgoingPiece, PageSpan
from pdserve.transfer.page_ids import unpack_page_ids
from pdserve.transfer.room_state import room_failure

if TYPE_CHECKING:
    from pdserve.transfer.peer import Peer
    from pdserve.transfer.sender_room import SenderRoom


class IpcWrites:
    """Mixin of PrefillTransferServer (an Endpoint)."""

    def end_room(self, room, *, notify: bool = False) -> None:
        super().end_room(room, notify=notify)
        if not self.backend.writes_decode_pages:
            return
        with self.lock:
            settled = room.close_writes()
        if room.failure is None:
            return  # NOTE: decode has the room whole: its pages are its engine's now
        if settled:
            self._released(room)
        else:
            self.unreleased[room.room] = room

    def _decode_pages(self, peer: Peer, msg: TransferRequest) -> tuple[list, list] | Failure:
        """The page ids decode asked us to write (`ipc`; empty otherwise), or what is wrong
        with them (checked against decode's pools as mapped)."""
        if not self.backend.writes_decode_pages:
            return [], []
        pools = peer.pools
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
        return lists[0], lists[1]

    def open_write(self, room: SenderRoom, span: PageSpan) -> tuple[list, list[list[int]]] | None:
        """The worker's thread, before writing a piece into decode's pages (`ipc`): where
        to, or None if the room takes no more writes; counts the write as in flight.

        NOTE: a decode process that exited freed its pools, and writing memory its owner
        freed is undefined behaviour for the writer's GPU context, so each write first checks
        that decode is alive (a peer found gone is dropped at once, without waiting for its
        silence): what is left is a decode dying while a copy runs."""
        peer = room.peer
        if peer is not None and peer.pools is not None and peer.watch.gone():
            error = "exited (its process is gone)"
            self.io.call(lambda: self.drop_peer(peer, FailureKind.PEER_LOST, error))
            return None
        with self.lock:
            peer = room.peer
            # NOTE: read once: the IO thread's `forget` may set it to None at any moment.
            mapped = None if peer is None else peer.pools
            if mapped is None or not room.open_write():
                return None
            pools = list(mapped)
        pages = span.page_lists(room.decode_pages, room.decode_draft_pages, len(pools))
        return pools, pages

    def write_event(self) -> tuple[torch.cuda.Event | None, bytes]:
        """The worker's thread: an event after the writes queued so far on the current
        stream, and its interprocess handle (`ipc_events`); (None, b"") on the CPU."""
        events = self.plane.events
        return events.record() if events is not None else (None, b"")

    def announce(self, room: SenderRoom, *steps: Callable[[], None]) -> None:
        """The worker's thread (`ipc`): run a room's send steps (`send_piece`, `finish_room`)
        right here when its peer has a lane, which `send` then takes, their messages in one
        packet where they fit; else on the IO thread."""
        peer = room.peer
        lane = peer.lane if peer is not None else None
        if lane is None:
            self.io.call(lambda: _run(steps))
            return
        lane.hold()
        try:
            _run(steps)
        finally:
            problem = lane.flush()
        if problem is not None:
            self.fail_on_io_thread(room, room_failure(problem, FailureKind.PEER_LOST))

    def send(self, peer: Peer, msg, *payload, copy: bool = True) -> bool:
        """`Endpoint.send`, but for what a decode peer's lane carries (`ipc_lane`), from
        whichever thread announces; a room whose announcement could not go fails."""
        lane = peer.lane
        if lane is None or not isinstance(msg, LANE_MESSAGES):
            return super().send(peer, msg, *payload, copy=copy)
        problem = lane.send(msg, *payload)
        room = self.rooms.get(msg.room)
        if problem is not None and room is not None:
            self.fail_on_io_thread(room, room_failure(problem, FailureKind.PEER_LOST))
        return problem is None

    def fail_on_io_thread(self, room, failure: Failure) -> None:
        """Fail a room that has not ended, from any thread: on the IO thread, which owns the
        connection (now, if that is the caller's)."""
        if room.done:
            return
        if self.io.is_current:
            self.fail_room(room, failure, notify=True)
        else:
            self.io.call(lambda: self.fail_room(room, failure, notify=True))

    def write_failed(self, room: SenderRoom, failure: Failure) -> None:
        """IO thread (`ipc`): a write given a destination was not queued (nothing of it
        runs): the room fails."""
        with self.lock:
            settled = room.write_ended()
        self.fail_room(room, failure, notify=True)
        if settled and self.unreleased.pop(room.room, None) is not None:
            self._released(room)

    def written(self, room: SenderRoom, piece: OutgoingPiece) -> None:
        """IO thread (`ipc`): a write into decode's pages completed (`piece` kept decode's
        pools mapped until now). If the room ended meanwhile and this was its last write,
        tell decode its pages are free."""
        with self.lock:
            settled = room.write_ended()
        if settled and self.unreleased.pop(room.room, None) is not None:
            self._released(room)

    def _released(self, room: SenderRoom) -> None:
        if room.peer is not None and self.peers.get(room.peer.key) is room.peer:
            self.send(room.peer, RoomReleased(room.room))

    def _release_if_settled(self, peer: Peer, room_id: int) -> None:
        """Tell decode a room it asked about is over here with no write in flight (`ipc`),
        unless a live room or a write still in flight says otherwise."""
        if not self.backend.writes_decode_pages or room_id in self.unreleased:
            return
        room = self.rooms.get(room_id)
        if room is None or room.writes_closed:
            self.send(peer, RoomReleased(room_id))


def _run(steps) -> None:
    for step in steps:
        step()
