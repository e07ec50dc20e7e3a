"""Transfer counters: bytes, latency, failures by reason. Torch-free; exported on /metrics by
the worker that owns them."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class TransferMetrics:
    bytes_sent: int = 0
    bytes_received: int = 0
    rooms_succeeded: int = 0
    latency_seconds_total: float = 0.0
    failures: Counter = field(default_factory=Counter)
    _recent: list[float] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def succeeded(self, latency_s: float) -> None:
        with self._lock:
            self.rooms_succeeded += 1
            self.latency_seconds_total += latency_s
            if len(self._recent) < 10_000:  # NOTE: bounded if nobody drains it
                self._recent.append(latency_s)

    def take_latencies(self) -> list[float]:
        """Latencies of rooms finished since the previous call."""
        with self._lock:
            taken, self._recent = self._recent, []
            return taken

    def failure(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] += 1
