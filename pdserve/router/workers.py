"""The workers a router knows, their health and their load. Torch-free."""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # `pdserve serve` workers behind the router (--worker-urls)


class NoHealthyWorker(RuntimeError):
    """Every worker of a role is out of rotation."""


class WorkersBusy(RuntimeError):
    """Every healthy worker of a role has as many requests in flight as the router allows
    (`--max-requests-per-worker`): back-pressure, answered with 429."""


@dataclass(eq=False)
class Worker:
    url: str
    role: Role
    bootstrap_port: int | None = None  # prefill only: where decode workers fetch KV
    healthy: bool = True
    last_error: str | None = None
    changed_at: float = field(default_factory=time.monotonic)
    in_flight: int = 0
    failures: int = 0  # consecutive failures: health checks, or requests that could not reach it
    discovered: bool = False  # found through DNS (leaves the pool when DNS drops it)

    @property
    def bootstrap_host(self) -> str:
        """The host part of the worker's URL (where its bootstrap port listens)."""
        rest = self.url.split("://", 1)[-1]
        return rest.rsplit(":", 1)[0].strip("[]") if ":" in rest else rest.split("/")[0]


class WorkerPool:
    """Workers of one role: the ones given on the command line, plus the ones DNS discovery
    found (`sync_discovered`). Failures in a row (`note_failure`) take a worker out of
    rotation, a good health check puts it back; `acquire`/`release` count requests in flight
    for load-aware policies and the per-worker bound."""

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
            return self._mark(worker, healthy, error)

    def note_failure(self, worker: Worker, error: str, threshold: int) -> bool:
        """One more failure in a row (a health check, or a request that could not reach the
        worker even on a fresh connection); at `threshold` the worker leaves rotation. True
        if this took it out. One transient error never does unless `threshold` is 1."""
        with self._lock:
            worker.failures += 1
            return worker.failures >= threshold and self._mark(worker, False, error)

    def note_success(self, worker: Worker) -> None:
        """A request reached the worker: failures are counted in a row."""
        with self._lock:
            worker.failures = 0

    def _mark(self, worker: Worker, healthy: bool, error: str | None) -> bool:
        worker.failures = 0 if healthy else worker.failures
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
