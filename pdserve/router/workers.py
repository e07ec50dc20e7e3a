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

    @property
    def bootstrap_host(self) -> str:
        """The host part of the worker's URL (where its bootstrap port listens)."""
        rest = self.url.split("://", 1)[-1]
        return rest.rsplit(":", 1)[0].strip("[]") if ":" in rest else rest.split("/")[0]


class WorkerPool:
    """Workers of one role. Health checks move workers out of and back into rotation;
    `acquire`/`release` count requests in flight for load-aware policies."""

    def __init__(self, role: Role, workers: list[Worker]):
        if not workers:
            raise ValueError(f"at least one {role.value} worker is needed")
        self.role = role
        self.workers = workers
        self._lock = threading.Lock()

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
