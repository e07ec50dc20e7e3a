"""The pieces a prefill worker handed to a decode worker of the same process (the `memory`
backend), waiting for the receiver to take them. Torch-free: a piece's bytes are opaque here.

An entry is keyed by the sending endpoint (its prefill instance, claimed once per process, so
rooms of two endpoints never share a key), the room and the piece's index, and belongs to the
connection it was announced on (the decode worker's Hello nonce, which both sides know): a
receiver takes or drops only its own. The sender withdraws the bytes of a room that ended on
its side, leaving a marker (`WITHDRAWN`) until the receiver reads the announcement: the
sender's abort, which follows that announcement on the connection, then wins over a
"missing piece" the receiver would otherwise report. Markers expire after `MARKER_TTL_S`.

Thread-safe: every prefill and decode IO thread of the process shares `REGISTRY`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

MAX_PIECES = 4096
MARKER_TTL_S = 60.0


class _Withdrawn:
    def __repr__(self) -> str:
        return "WITHDRAWN"


WITHDRAWN = _Withdrawn()  # what `take` answers for a piece the sender withdrew


@dataclass
class _Entry:
    data: object  # the piece's bytes; None once withdrawn
    owner: Hashable  # the connection it was announced on
    withdrawn_at: float = 0.0


class PieceRegistry:
    def __init__(
        self,
        capacity: int = MAX_PIECES,
        marker_ttl_s: float = MARKER_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        """capacity: entries (pieces and markers) held at once, for every endpoint together."""
        self.capacity = capacity
        self.marker_ttl_s = marker_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        # sender -> (room, index) -> entry
        self._senders: dict[int, dict[tuple[int, int], _Entry]] = {}

    # ---- the sending side ------------------------------------------------------------

    def open_sender(self, sender: int) -> None:
        """Claim `sender` (a prefill instance) for an endpoint's plane."""
        with self._lock:
            if sender in self._senders:
                raise ValueError(f"prefill instance {sender} has a memory plane already")
            self._senders[sender] = {}

    def close_sender(self, sender: int) -> None:
        """The endpoint stopped: its entries go (no receiver can be told otherwise)."""
        with self._lock:
            self._senders.pop(sender, None)

    def put(self, sender: int, room: int, index: int, data, owner: Hashable) -> str | None:
        """Register a piece before it is announced; why it cannot be, if it cannot."""
        with self._lock:
            entries = self._senders.get(sender)
            if entries is None:
                return f"prefill instance {sender} has no memory plane (it stopped)"
            if self._count() >= self.capacity:
                return (
                    f"the in-process KV registry is full ({self.capacity} pieces wait for "
                    "their receivers)"
                )
            if (room, index) in entries:
                return f"KV piece {index} of room {room} is registered already"
            entries[(room, index)] = _Entry(data, owner)
            return None

    def withdraw(self, sender: int, live_rooms: set[int]) -> None:
        """Drop the bytes of `sender`'s pieces whose room is not among `live_rooms` (a marker
        stays for the receiver), and forget markers past their time."""
        self._withdraw(sender, lambda room, entry: room not in live_rooms)

    def withdraw_owner(self, sender: int, owner: Hashable) -> None:
        """The sender dropped the connection `owner`: the same for every piece announced on it."""
        self._withdraw(sender, lambda room, entry: entry.owner == owner)

    def _withdraw(self, sender: int, ended: Callable[[int, _Entry], bool]) -> None:
        now = self._clock()
        with self._lock:
            entries = self._senders.get(sender, {})
            for key, entry in list(entries.items()):
                if entry.data is not None and ended(key[0], entry):
                    entry.data, entry.withdrawn_at = None, now
                elif entry.data is None and now - entry.withdrawn_at > self.marker_ttl_s:
                    del entries[key]

    # ---- the receiving side ----------------------------------------------------------

    def take(self, sender: int, room: int, index: int, owner: Hashable):
        """Remove and return a piece announced on `owner`: its bytes, WITHDRAWN, or None if
        there is no such piece of that connection."""
        with self._lock:
            entries = self._senders.get(sender, {})
            entry = entries.get((room, index))
            if entry is None or entry.owner != owner:
                return None
            del entries[(room, index)]
        return WITHDRAWN if entry.data is None else entry.data

    def drop_room(self, sender: int, room: int, owner: Hashable) -> None:
        """The receiver's room ended: its pieces not read yet go."""
        with self._lock:
            entries = self._senders.get(sender, {})
            for key in [k for k, e in entries.items() if k[0] == room and e.owner == owner]:
                del entries[key]

    def drop_owner(self, sender: int, owner: Hashable) -> None:
        """The receiver dropped the connection `owner`: every piece announced on it goes."""
        with self._lock:
            entries = self._senders.get(sender, {})
            for key in [k for k, e in entries.items() if e.owner == owner]:
                del entries[key]

    # ---- either ----------------------------------------------------------------------

    def has_sender(self, sender: int) -> bool:
        with self._lock:
            return sender in self._senders

    def holding(self, sender: int) -> int:
        """`sender`'s entries that still hold a piece's bytes (not markers)."""
        with self._lock:
            return sum(e.data is not None for e in self._senders.get(sender, {}).values())

    def __len__(self) -> int:
        """Entries held (pieces and markers)."""
        with self._lock:
            return self._count()

    def _count(self) -> int:
        """Under the lock."""
        return sum(len(entries) for entries in self._senders.values())


REGISTRY = PieceRegistry()
