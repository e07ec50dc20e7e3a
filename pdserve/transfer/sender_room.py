"""One room on the prefill side of a handoff (see `prefill_side`): its state, the peer that
asked for it, the pages it asked for, how many pieces went out, and what is kept alive while
they are sent. Torch-free, and no reference to the server: the server (on its IO thread) and
the prefill worker's `Sender` change it only through its methods; any thread reads it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdserve.protocol.failures import Failure
from pdserve.transfer.kv_piece import PageSpan
from pdserve.transfer.room_state import Room, RoomState, TransferState, room_failure

if TYPE_CHECKING:
    from pdserve.protocol.transfer_messages import TransferRequest
    from pdserve.transfer.peer import Peer


class SenderRoom(Room):
    def __init__(self, room: int, state: RoomState):
        super().__init__(room, state)
        self.peer: Peer | None = None
        # The pages decode reserved (from its transfer request): what the pieces must cover,
        # but the first `num_cached_pages`, which decode holds already.
        self.num_pages = 0
        self.num_draft_pages = 0
        self.num_cached_pages = 0
        self._kept: list[object] = []
        self.pieces_sent = 0
        self.bytes_sent = 0
        # Asked for by this worker's own request (not only by a decode peer's transfer request).
        self.claimed = False
        self.started_at = time.monotonic()
        # When each protocol step happened (monotonic clock), for latency breakdowns.
        self.stamps: dict[str, float] = {}

    def claim(self) -> SenderRoom:
        self.claimed = True
        return self

    def restart_clock(self) -> None:
        """The prefill began computing this room: the progress deadline counts from now (the
        wait in the prefill queue before it had its own, longer, deadline)."""
        self._state.restart_clock()

    def stamp(self, step: str, *, first: bool = False) -> None:
        """When `step` happened (`first`: only the first time)."""
        if not first or step not in self.stamps:
            self.stamps[step] = time.monotonic()

    def attach(self, peer: Peer, request: TransferRequest, queue_s: float) -> None:
        """Decode reserved pages for this room (`request`): wait for the prefill queue up to
        `queue_s` (not a stall: `restart_clock` restarts the progress deadline when compute
        begins)."""
        self.peer = peer
        self.num_pages, self.num_draft_pages = request.num_pages, request.num_draft_pages
        self.num_cached_pages = request.num_cached_pages
        if self._state.state is TransferState.BOOTSTRAPPING:
            self._state.advance(TransferState.WAITING_FOR_INPUT)
            self._state.hold(queue_s)

    def whole(self) -> PageSpan:
        """Every page decode reserved and does not hold already."""
        first = self.num_cached_pages
        return PageSpan(first, self.num_pages - first, 0, self.num_draft_pages)

    def begin_piece(self) -> int | Failure:
        """The next piece's index (the room is TRANSFERRING from its first); why not, if it
        cannot send one. (On the worker's thread when announced over `ipc_lane`.)"""
        state = self._state.state
        if self.peer is None or state not in (
            TransferState.WAITING_FOR_INPUT,
            TransferState.TRANSFERRING,
        ):
            return room_failure(f"a KV piece in state {state.name}")
        if state is TransferState.WAITING_FOR_INPUT:
            if not self._state.advance(TransferState.TRANSFERRING):
                return room_failure("a KV piece for a room that failed")  # NOTE: meanwhile
        else:
            self._state.restart_clock()
        return self.skip_piece()

    def skip_piece(self) -> int:
        """Count a piece that goes out whatever the room's state (its parts were posted by the
        other ranks already); its index."""
        self.pieces_sent += 1
        return self.pieces_sent - 1

    def sent(self, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.stamp("first_piece_sent", first=True)

    def keep(self, kept: object) -> None:
        """Keep `kept` alive until the room ends (frames sent zero-copy are views of it)."""
        self._kept.append(kept)

    def acked(self) -> bool:
        """Decode has the room whole; False if it had ended otherwise."""
        self.stamp("ack_seen")
        if self._state.state is not TransferState.TRANSFERRING:
            return False
        return self._state.advance(TransferState.SUCCESS)

    def drop_buffers(self) -> list:
        """The room ended: let go of what it kept (nothing to recycle)."""
        self._kept = []
        return []
