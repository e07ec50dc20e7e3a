"""How the router picks a worker among the healthy ones. Torch-free.

`cache_aware` follows sglang-router's policy of that name: while the workers' loads (requests
this router has in flight on them) are balanced, a request goes to the worker that was sent
the longest prefix of it (prefix_index.py), if that covers more than `cache_threshold` of it,
else to the worker whose index is smallest (the most room in its cache); once loads are
imbalanced (max - min > `balance_abs_threshold` and max > min x `balance_rel_threshold`), to
the least loaded worker. Either way the request's prefixes are remembered for the worker once
it accepted the request (`accepted`), so a conversation's next turn follows its last one while
that worker keeps up, and requests every worker refuses do not push real prefixes out."""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.router.prefix_index import PrefixIndex, RoutingKey, block_names, block_units
from pdserve.router.workers import NoHealthyWorker, Worker

POLICIES = ("round_robin", "random", "least_load", "cache_aware")


class Policy(Protocol):
    def choose(
        self,
        workers: Sequence[Worker],
        *,
        exclude: Sequence[Worker] = (),
        key: RoutingKey | None = None,
    ) -> Worker:
        """Pick one of `workers`, avoiding `exclude` when anything else is left (a retry
        should land elsewhere); `key` is the request's routing key (prefix_index.py), which
        only cache-aware policies read."""

    def accepted(self, worker: Worker, key: RoutingKey | None) -> None:
        """`worker` took the request with this routing key (it answered it, or its room
        opened): what a cache-aware policy remembers."""


class _Forgetful:
    """A policy that does not read routing keys."""

    def accepted(self, worker: Worker, key: RoutingKey | None) -> None:
        pass


def _candidates(workers: Sequence[Worker], exclude: Sequence[Worker]) -> list[Worker]:
    if not workers:
        raise NoHealthyWorker("no healthy worker to choose from")
    others = [w for w in workers if all(w is not x for x in exclude)]
    return others or list(workers)


class RoundRobin(_Forgetful):
    def __init__(self) -> None:
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def choose(self, workers: Sequence[Worker], *, exclude=(), key=None) -> Worker:
        candidates = _candidates(workers, exclude)
        with self._lock:
            return candidates[next(self._counter) % len(candidates)]


class Random(_Forgetful):
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, workers: Sequence[Worker], *, exclude=(), key=None) -> Worker:
        return self._rng.choice(_candidates(workers, exclude))


class LeastLoad(_Forgetful):
    """Fewest requests in flight from this router; ties go to the earliest listed."""

    def choose(self, workers: Sequence[Worker], *, exclude=(), key=None) -> Worker:
        return min(_candidates(workers, exclude), key=lambda w: w.in_flight)


@dataclass(frozen=True)
class CacheAwareSettings:
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    max_index_blocks: int = 1 << 20  # per worker


class CacheAware:
    def __init__(self, settings: CacheAwareSettings | None = None) -> None:
        self.settings = settings or CacheAwareSettings()
        self._indexes: dict[str, PrefixIndex] = {}
        self._lock = threading.Lock()
        # NOTE: the last key's block names: `accepted` mostly follows its `choose` at once.
        self._last: tuple[RoutingKey | None, list[int]] = (None, [])

    def choose(self, workers: Sequence[Worker], *, exclude=(), key=None) -> Worker:
        candidates = _candidates(workers, exclude)
        with self._lock:
            names = self._names(key)
            indexes = [self._index(w) for w in candidates]
            return self._pick(candidates, indexes, names, key)

    def accepted(self, worker: Worker, key: RoutingKey | None) -> None:
        with self._lock:
            names = self._names(key)
            if names:
                self._index(worker).insert(names)

    def _names(self, key: RoutingKey | None) -> list[int]:
        if key is None:
            return []
        last_key, names = self._last
        if last_key is not key:
            names = block_names(key)
            self._last = (key, names)
        return names

    def _pick(self, candidates, indexes, names, key) -> Worker:
        loads = [w.in_flight for w in candidates]
        least_loaded = candidates[loads.index(min(loads))]
        s = self.settings
        imbalanced = (
            max(loads) - min(loads) > s.balance_abs_threshold
            and max(loads) > min(loads) * s.balance_rel_threshold
        )
        if imbalanced or not names:
            return least_loaded
        matches = [index.match(names) for index in indexes]
        # NOTE: the longest match; among equal ones the least loaded, then the first listed.
        best = max(range(len(candidates)), key=lambda i: (matches[i], -loads[i], -i))
        if matches[best] * block_units(key) > s.cache_threshold * len(key):
            return candidates[best]
        roomiest = min(range(len(candidates)), key=lambda i: (len(indexes[i]), loads[i], i))
        return candidates[roomiest]

    def _index(self, worker: Worker) -> PrefixIndex:
        index = self._indexes.get(worker.url)
        if index is None:
            index = self._indexes[worker.url] = PrefixIndex(self.settings.max_index_blocks)
        return index


def make_policy(
    name: str, seed: int | None = None, cache_aware: CacheAwareSettings | None = None
) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return Random(seed)
    if name == "least_load":
        return LeastLoad()
    if name == "cache_aware":
        return CacheAware(cache_aware)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
