"""How the router picks a worker among the healthy ones. Torch-free."""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Sequence
from typing import Protocol

from pdserve.router.workers import NoHealthyWorker, Worker

POLICIES = ("round_robin", "random", "least_load")


class Policy(Protocol):
    def choose(self, workers: Sequence[Worker], *, exclude: Sequence[Worker] = ()) -> Worker:
        """Pick one of `workers`, avoiding `exclude` when anything else is left (a retry
        should land elsewhere)."""


def _candidates(workers: Sequence[Worker], exclude: Sequence[Worker]) -> list[Worker]:
    if not workers:
        raise NoHealthyWorker("no healthy worker to choose from")
    others = [w for w in workers if all(w is not x for x in exclude)]
    return others or list(workers)


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def choose(self, workers: Sequence[Worker], *, exclude: Sequence[Worker] = ()) -> Worker:
        candidates = _candidates(workers, exclude)
        with self._lock:
            return candidates[next(self._counter) % len(candidates)]


class Random:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, workers: Sequence[Worker], *, exclude: Sequence[Worker] = ()) -> Worker:
        return self._rng.choice(_candidates(workers, exclude))


class LeastLoad:
    """Fewest requests in flight from this router; ties go to the earliest listed."""

    def choose(self, workers: Sequence[Worker], *, exclude: Sequence[Worker] = ()) -> Worker:
        return min(_candidates(workers, exclude), key=lambda w: w.in_flight)


def make_policy(name: str, seed: int | None = None) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return Random(seed)
    if name == "least_load":
        return LeastLoad()
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
