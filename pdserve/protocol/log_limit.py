"""Warnings at a bounded rate: a peer flooding a worker with bad messages, or a failing
worker under load, must not flood the log (or slow the process down writing it). Torch-free,
so the router and the transfer layer share it.

A token bucket per key: `burst` lines at once, then `per_second` on average; lines held back
are counted and reported with the next line of that key that passes. Keys should come from a
small set (a call site, a role and a status; never a request id).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable


class RateLimitedLog:
    def __init__(
        self,
        logger: logging.Logger,
        per_second: float = 1.0,
        burst: int = 5,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.logger = logger
        self.per_second = per_second
        self.burst = burst
        self._clock = clock
        # key -> (tokens, when they were counted, lines held back since the last one logged)
        self._buckets: dict[Hashable, tuple[float, float, int]] = {}

    def warning(self, message: str, *args, key: Hashable = None) -> bool:
        """Log unless `key` is over its rate; True when the line was written."""
        return self.log(logging.WARNING, message, *args, key=key)

    def info(self, message: str, *args, key: Hashable = None) -> bool:
        return self.log(logging.INFO, message, *args, key=key)

    def log(self, level: int, message: str, *args, key: Hashable = None) -> bool:
        now = self._clock()
        tokens, counted_at, held = self._buckets.get(key, (float(self.burst), now, 0))
        tokens = min(self.burst, tokens + (now - counted_at) * self.per_second)
        if tokens < 1:
            self._buckets[key] = (tokens, now, held + 1)
            return False
        self._buckets[key] = (tokens - 1, now, 0)
        if held:
            message += f" ({held} similar lines suppressed)"
        self.logger.log(level, message, *args)
        return True
