"""A peer worker as one side of a handoff sees it: its connection's outbox, its name once
known, when it was last heard from, and its live rooms. Torch-free; the endpoint owns it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.transfer.outbox import Outbox


@dataclass
class Peer:
    """A peer worker as one side sees it."""

    key: Any  # the ROUTER identity (prefill side) or the ZMQ address (decode side)
    outbox: Outbox
    name: str = ""  # the peer's worker id once known
    registered: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    last_heartbeat: float = 0.0
    # When it last registered or was given a room: among idle peers, the oldest gives way.
    last_busy: float = field(default_factory=time.monotonic)
    rooms: set[int] = field(default_factory=set)

    def __str__(self) -> str:
        """Its worker id, else its address (decode side) or "(unregistered)" (prefill side)."""
        return self.name or (self.key if isinstance(self.key, str) else "(unregistered)")
