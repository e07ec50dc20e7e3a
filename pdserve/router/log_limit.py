"""Warnings that repeat, logged at a bounded rate: a failing worker or a storm of bad requests
must not flood the router's log (or slow it down writing it). Torch-free."""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable


class RateLimitedLog:
    """At most one warning per key every `interval_s`; the next one that gets through says
    how many were held back in between."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[Hashable, float] = {}
        self._held: dict[Hashable, int] = {}

    def warning(self, key: Hashable, message: str, *args) -> bool:
        """Log unless a warning with this key went out less than `interval_s` ago; True if
        logged. Keys should come from a small set (a role and a status, not a request id)."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        held = self._held.pop(key, 0)
        self._last[key] = now
        if held:
            message += f" ({held} more like it since the last one, not logged)"
        self.logger.warning(message, *args)
        return True
