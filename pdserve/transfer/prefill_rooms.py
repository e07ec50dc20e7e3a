"""The prefill side's room table: rooms made by this worker's requests (`sender`) or by a
decode peer's transfer request, whichever comes first, and what ends them early.

A room a decode peer asked for whose prefill request has not arrived waits for it (up to the
queue timeout); such rooms are bounded, per peer (`max_waiting_rooms_per_peer`) and in all
(`max_waiting_rooms`), and a request beyond that is refused at once with an `AbortRoom`
naming the limit, leaving only a tombstone (bounded too, see room_state). What both threads
share (the rooms, which of them wait, the check for a tombstone and what follows it) changes
under the endpoint's lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.protocol.failures import Failure, FailureKind, FailureStage
from pdserve.protocol.transfer_messages import AbortRoom, TransferRequest
from pdserve.transfer.room_state import RoomState, room_failure
from pdserve.transfer.sender_room import SenderRoom

if TYPE_CHECKING:
    from pdserve.transfer.peer import Peer
    from pdserve.transfer.prefill_peers import DecodePeer


class PrefillRooms:
    """Mixin of PrefillTransferServer (an Endpoint)."""

    # ---- any thread ------------------------------------------------------------------

    def _room(self, room: int) -> SenderRoom:
        """The room, created if new (failed at once if it ended lately); under the lock."""
        if room not in self.rooms:
            state = RoomState(
                room,
                progress_timeout_s=self.config.progress_timeout_s,
                on_change=self.doorbell.ring,
            )
            ended, failure = self.tombstones.lookup(room)
            if ended and failure is None:
                state.fail(room_failure("bootstrap_room reused: it finished", FailureKind.INVALID))
            elif ended:
                state.fail(failure)
            self.rooms[room] = SenderRoom(room, state)
        return self.rooms[room]

    def release(self, room: int) -> None:
        with self.lock:
            self.rooms.pop(room, None)
            self._stop_waiting(room)

    def release_unclaimed(self, room) -> None:
        with self.lock:
            if not room.claimed and self.rooms.get(room.room) is room:
                del self.rooms[room.room]
                self._stop_waiting(room.room)

    def _stop_waiting(self, room: int) -> None:
        """The room no longer waits for its prefill request (under the lock)."""
        peer = self.waiting_rooms.pop(room, None)
        if peer is not None:
            peer.waiting_rooms.discard(room)

    def _waiting_limit(self, peer: DecodePeer) -> str | None:
        """Why a transfer request of `peer`'s for a room we have not heard of is refused:
        too many rooms wait for their prefill request (under the lock); None if it may wait."""
        per_peer, total = self.config.max_waiting_rooms_per_peer, self.config.max_waiting_rooms
        if len(peer.waiting_rooms) >= per_peer:
            held = f"{len(peer.waiting_rooms)} rooms of decode peer {peer}"
            return f"{held} wait for their prefill request (limit {per_peer} a peer)"
        if len(self.waiting_rooms) >= total:
            return f"{len(self.waiting_rooms)} rooms wait for their prefill request (limit {total})"
        return None

    # ---- IO thread -------------------------------------------------------------------

    def _abort_from_peer(self, peer: Peer, msg: AbortRoom) -> None:
        failure = self.peer_failure(msg.failure)
        with self.lock:
            room = self.rooms.get(msg.room)
            if room is None:
                # NOTE: the prefill leg may not have arrived yet; it fails when it does. Under
                # the lock: a leg arriving meanwhile either finds this tombstone or the room.
                self.tombstones.add_new(msg.room, failure)
        if room is not None:
            self.fail_room(room, failure, notify=False)
            if room.peer is not peer:  # decode asks again, on a new connection (`ipc`)
                self.plane.release_if_settled(peer, msg.room)
            return
        self.plane.release_if_settled(peer, msg.room)

    def refuse_room(self, peer: Peer, room_id: int, failure: Failure) -> None:
        with self.lock:
            room = self._room(room_id)
        room.fail(failure)
        self.tombstones.add(room_id, room.failure)
        self._reply(peer.key, AbortRoom(room_id, room.failure))
        self.plane.release_if_settled(peer, room_id)

    def _refuse_waiting(self, peer: Peer, room_id: int, limit: str) -> None:
        """Refuse a room over the waiting-room limit: no room is made for it, only its
        tombstone (a prefill request for it after all fails at once, with the reason)."""
        message = f"prefill {self.prefill_id} refused the room: {limit}"
        failure = Failure(FailureKind.UNAVAILABLE, FailureStage.BOOTSTRAP, message)
        self.tombstones.add_new(room_id, failure)
        self.send(peer, AbortRoom(room_id, failure))

    def _transfer_request(self, peer: Peer, msg: TransferRequest) -> None:
        ended, failure = self.tombstones.lookup(msg.room)
        if ended:
            # A room that failed before decode asked (e.g. prefill rejected the prompt) still
            # fails decode's room at once; a duplicate for a finished room is ignored.
            if failure is not None:
                self.send(peer, AbortRoom(msg.room, failure))
                self.plane.release_if_settled(peer, msg.room)
            return
        # NOTE: checked before any room exists for it. Only a prompt longer than this worker's
        # max_model_len needs more pages: the request is at fault, as when the prefill leg's
        # rejection reaches the room first.
        longest = max(msg.num_pages, msg.num_draft_pages)
        if longest > self.max_room_pages:
            message = (
                f"prefill rejected the request: the prompt exceeds this prefill worker's context "
                f"length (its KV needs {longest} pages, at most {self.max_room_pages})"
            )
            self.refuse_room(peer, msg.room, room_failure(message, FailureKind.INVALID))
            return
        if not 0 <= msg.num_cached_pages < max(msg.num_pages, 1):
            message = (
                f"decode's transfer request skips {msg.num_cached_pages} cached pages of a room "
                f"of {msg.num_pages}: at least the last page must be sent"
            )
            self.refuse_room(peer, msg.room, room_failure(message))
            return
        accepted = self.plane.accept_pages(peer, msg)
        if isinstance(accepted, Failure):
            self.refuse_room(peer, msg.room, accepted)
            return
        with self.lock:
            room, limit = self.rooms.get(msg.room), None
            if room is None:  # NOTE: only a room this request makes waits for its prefill
                limit = self._waiting_limit(peer)
                if limit is None:
                    room = self._room(msg.room)
                    if not room.done:
                        self.waiting_rooms[msg.room] = peer
                        peer.waiting_rooms.add(msg.room)
        if limit is not None:
            self._refuse_waiting(peer, msg.room, limit)
            return
        if room.peer is None and not room.done:  # else a duplicate, or a room that ended
            # NOTE: the plane first: the worker's thread may write once the room is attached
            self.plane.room_attached(room, accepted)
            self.attach(room, peer, msg, self.config.queue_timeout_s)

    def end_room(self, room, *, notify: bool = False) -> None:
        super().end_room(room, notify=notify)
        with self.lock:
            self._stop_waiting(room.room)
