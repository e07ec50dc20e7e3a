"""A log that keeps its volume bounded when a peer floods us with bad messages. Torch-free.

A token bucket per call site: `burst` lines at once, then `per_second` on average; lines
dropped meanwhile are counted and reported with the next line that passes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


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
        self._tokens = float(burst)
        self._refilled_at = clock()
        self.dropped = 0

    def warning(self, message: str, *args) -> bool:
        """Log unless over the rate; True when the line was written."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._refilled_at) * self.per_second)
        self._refilled_at = now
        if self._tokens < 1:
            self.dropped += 1
            return False
        self._tokens -= 1
        if self.dropped:
            message += f" ({self.dropped} similar lines suppressed)"
            self.dropped = 0
        self.logger.warning(message, *args)
        return True
