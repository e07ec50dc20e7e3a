"""Transfer counters: bytes and latency. Torch-free; exported on /metrics by the worker that
owns them (failures are counted by kind in the handoffs, see disagg.handoff_common)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class TransferMetrics:
    bytes_sent: int = 0
    bytes_received: int = 0
    # Decode: KV bytes not transferred because this worker's prefix cache held them already.
    bytes_skipped: int = 0
    pieces_sent: int = 0  # KV pieces announced (a room streamed while prefilling has several)
    rooms_succeeded: int = 0
    malformed_messages: int = 0  # dropped peer messages that failed the schema checks
    latency_seconds_total: float = 0.0
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
