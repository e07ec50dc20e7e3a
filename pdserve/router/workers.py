"""The workers a router knows, their health and their load. Torch-free."""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class NoHealthyWorker(RuntimeError):
    """Every worker of a role is out of rotation."""


@dataclass(eq=False)
class Worker:
    url: str
    role: Role
    bootstrap_port: int | None = None  # prefill only: where decode workers fetch KV
    healthy: bool = True
    last_error: str | None = None
    changed_at: float = field(default_factory=time.monotonic)
    in_flight: int = 0
    failed_checks: int = 0  # consecutive failed health checks
    discovered: bool = False  # found through DNS (leaves the pool when DNS drops it)

    @property
    def bootstrap_host(self) -> str:
        """The host part of the worker's URL (where its bootstrap port listens)."""
        rest = self.url.split("://", 1)[-1]
        return rest.rsplit(":", 1)[0].strip("[]") if ":" in rest else rest.split("/")[0]


class WorkerPool:
    """Workers of one role: the ones given on the command line, plus the ones DNS discovery
    found (`sync_discovered`). Health checks move workers out of and back into rotation;
    `acquire`/`release` count requests in flight for load-aware policies."""

    def __init__(self, role: Role, workers: list[Worker]):
        self.role = role
        self.workers = workers
        self._lock = threading.Lock()

    def sync_discovered(self, urls: set[str]) -> tuple[list[str], list[str]]:
        """Make the discovered workers exactly `urls`: new ones join out of rotation (the
        next health check brings them in), vanished ones leave. Workers given on the
        command line stay. Returns (added, removed) URLs."""
        with self._lock:
            known = {w.url for w in self.workers}
            removed = [w.url for w in self.workers if w.discovered and w.url not in urls]
            added = sorted(urls - known)
            self.workers = [w for w in self.workers if not w.discovered or w.url in urls] + [
                Worker(url, self.role, healthy=False, discovered=True) for url in added
            ]
            return added, removed

    def healthy(self) -> list[Worker]:
        with self._lock:
            return [w for w in self.workers if w.healthy]

    def mark(self, worker: Worker, healthy: bool, error: str | None = None) -> bool:
        """Move a worker in or out of rotation; True if that changed anything."""
        with self._lock:
            worker.failed_checks = 0 if healthy else worker.failed_checks
            changed = worker.healthy != healthy
            worker.healthy = healthy
            worker.last_error = None if healthy else error
            if changed:
                worker.changed_at = time.monotonic()
            return changed

    def acquire(self, worker: Worker) -> None:
        with self._lock:
            worker.in_flight += 1

    def release(self, worker: Worker) -> None:
        with self._lock:
            worker.in_flight = max(0, worker.in_flight - 1)
