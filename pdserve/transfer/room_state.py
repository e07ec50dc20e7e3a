"""Per-room transfer state on one side of a handoff. Torch-free.

`Bootstrapping -> WaitingForInput -> Transferring -> Success`, or `Failed` from anywhere.
States only move forward; `Failed` is sticky and keeps the first `Failure` (its stage is the
room's to say: `bootstrap` before any KV moved, `transfer` after); `Success` is final.
What goes wrong with a room is a `Failure` from where it is found (`room_failure`), never a
string. Every state has a deadline: a room that makes no progress for `progress_timeout_s`
fails (TIMEOUT) with a message that names the state it was stuck in. Finished rooms leave
a tombstone for a while, so a late or duplicate message for them is recognised and ignored
rather than applied to a new request.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from pdserve.protocol.failures import Failure, FailureKind, FailureStage


def room_failure(message: str, kind: FailureKind = FailureKind.TRANSFER) -> Failure:
    """What went wrong with a room, as the room will record it (`RoomState.fail` sets the
    stage from how far the room got)."""
    return Failure(kind, FailureStage.TRANSFER, message)


class TransferState(enum.IntEnum):
    BOOTSTRAPPING = 0
    WAITING_FOR_INPUT = 1
    TRANSFERRING = 2
    SUCCESS = 3
    FAILED = 4


class InvalidTransition(RuntimeError):
    """A caller tried to move a room backwards or out of a final state."""


class RoomState:
    def __init__(
        self,
        room: int,
        *,
        progress_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] | None = None,
    ):
        """on_change: called (on the changing thread) after every move a worker acts on and
        on failing: the endpoint's doorbell, which wakes the worker's engine loop. Moving into
        TRANSFERRING does not call it: no worker acts on it, and a woken engine thread only
        takes the interpreter from the IO thread that is taking the room's next messages."""
        if progress_timeout_s <= 0:
            raise ValueError(f"progress_timeout_s must be positive, got {progress_timeout_s}")
        self.room = room
        self.progress_timeout_s = progress_timeout_s
        self._clock = clock
        self.state = TransferState.BOOTSTRAPPING
        self.failure: Failure | None = None
        self.entered_at = clock()
        self.limit_s = progress_timeout_s
        self._on_change = on_change
        # NOTE: each move checks and sets under it: two threads may move a room (the IO
        # thread fails it while the worker's thread announces a piece, with `ipc_lane`).
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self.state in (TransferState.SUCCESS, TransferState.FAILED)

    def advance(self, new_state: TransferState) -> bool:
        """Move forward to `new_state`. False (and no change) if the room already failed;
        InvalidTransition for a move backwards, sideways, out of Success or into Failed
        (use `fail`)."""
        if new_state is TransferState.FAILED:
            raise InvalidTransition("use fail(failure) to fail a room")
        with self._lock:
            if self.state is TransferState.FAILED:
                return False
            if self.state is TransferState.SUCCESS or new_state <= self.state:
                raise InvalidTransition(
                    f"room {self.room}: {self.state.name} -> {new_state.name} is not forward"
                )
            self.state = new_state
            self.entered_at = self._clock()
            self.limit_s = self.progress_timeout_s
        if new_state is not TransferState.TRANSFERRING:
            self._changed()
        return True

    def hold(self, limit_s: float) -> None:
        """Let the room wait up to `limit_s` in its current state (a queue, not a stall);
        the next `advance` or `restart_clock` returns to progress_timeout_s."""
        self.limit_s = limit_s

    def restart_clock(self) -> None:
        """Work on the room starts now: it has progress_timeout_s from here."""
        self.entered_at = self._clock()
        self.limit_s = self.progress_timeout_s

    def fail(self, failure: Failure) -> bool:
        """Fail the room with `failure`, its stage the room's (`bootstrap` unless KV moved).
        False if it already ended (the first outcome stands)."""
        with self._lock:
            if self.done:
                return False
            moved = self.state is TransferState.TRANSFERRING
            stage = FailureStage.TRANSFER if moved else FailureStage.BOOTSTRAP
            self.failure = Failure(failure.kind, stage, failure.message)
            self.state = TransferState.FAILED
            self.entered_at = self._clock()
        self._changed()
        return True

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def check_deadline(self) -> bool:
        """Fail the room if it sat in its state past the deadline; True if it failed now."""
        if self.done:
            return False
        waited = self._clock() - self.entered_at
        if waited <= self.limit_s:
            return False
        message = f"timed out after {waited:.1f} s in {self.state.name} (limit {self.limit_s:g} s)"
        return self.fail(room_failure(message, FailureKind.TIMEOUT))


class Room:
    """A room on either side: its number and state, and no reference to the endpoint that
    owns it. Only the room changes its state and attributes (the endpoint calls `fail`,
    `check_deadline` and the side's own methods); any thread reads."""

    claimed = True  # a worker's own request asked for it (that worker releases it)

    def __init__(self, room: int, state: RoomState):
        self.room = room
        self._state = state

    def poll(self) -> TransferState:
        return self._state.state

    @property
    def done(self) -> bool:
        return self._state.done

    @property
    def failure(self) -> Failure | None:
        return self._state.failure

    def fail(self, failure: Failure) -> bool:
        return self._state.fail(failure)

    def check_deadline(self) -> bool:
        return self._state.check_deadline()


# NOTE: a tombstone keeps at most this much of a failure's message (a peer's AbortRoom names
# its own): with the entry limit, that bounds the table's memory (~0.5 KiB an entry).
TOMBSTONE_MESSAGE_CHARS = 256
TOMBSTONE_CAPACITY = 65_536


class Tombstones:
    """Rooms that ended recently, remembered for `ttl_s` (at most `capacity` of them, the
    oldest forgotten first), with the failure of those that failed (so a late peer can still
    be told why).

    Thread-safe: a worker's engine thread and its transfer IO thread both use an endpoint's
    tombstones, and every call expires old entries, so each call runs under the table's own
    lock (never held while calling out)."""

    def __init__(
        self,
        ttl_s: float,
        capacity: int = TOMBSTONE_CAPACITY,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._clock = clock
        self._lock = threading.Lock()
        self._ended: OrderedDict[int, tuple[float, Failure | None]] = OrderedDict()

    def add(self, room: int, failure: Failure | None = None) -> None:
        with self._lock:
            self._put(room, failure)

    def add_new(self, room: int, failure: Failure | None = None) -> bool:
        """Add `room` unless it ended lately already (its entry stays); True if added."""
        with self._lock:
            self._expire()
            if room in self._ended:
                return False
            self._put(room, failure)
            return True

    def lookup(self, room: int) -> tuple[bool, Failure | None]:
        """Whether the room ended lately, and why it failed (None: it succeeded), at once."""
        with self._lock:
            self._expire()
            entry = self._ended.get(room)
        return (False, None) if entry is None else (True, entry[1])

    def failure(self, room: int) -> Failure | None:
        """Why the room failed, or None if it succeeded or is unknown."""
        return self.lookup(room)[1]

    def __contains__(self, room: int) -> bool:
        return self.lookup(room)[0]

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._ended)

    def _put(self, room: int, failure: Failure | None) -> None:
        """Under the lock."""
        if failure is not None and len(failure.message) > TOMBSTONE_MESSAGE_CHARS:
            message = failure.message[: TOMBSTONE_MESSAGE_CHARS - 3] + "..."
            failure = Failure(failure.kind, failure.stage, message)
        if failure is None and room in self._ended:
            failure = self._ended[room][1]  # NOTE: a failure stays a failure
        self._ended[room] = (self._clock(), failure)
        self._ended.move_to_end(room)
        self._expire()

    def _expire(self) -> None:
        """Under the lock: forget entries past their time or over the limit, oldest first."""
        horizon = self._clock() - self.ttl_s
        ended = self._ended
        while ended:
            oldest = next(iter(ended))
            if ended[oldest][0] >= horizon and len(ended) <= self.capacity:
                break
            ended.popitem(last=False)
