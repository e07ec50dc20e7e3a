"""Pairing a prefill and a decode worker for one request, and the bootstrap fields that tell
both of them about each other (SGLang's PD protocol: same body to both). Torch-free."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from pdserve.router.policies import Policy
from pdserve.router.prefix_index import RoutingKey
from pdserve.router.workers import NoHealthyWorker, Worker, WorkerPool, WorkersBusy

ROOM_BITS = 63


@dataclass(frozen=True)
class Pair:
    prefill: Worker
    decode: Worker
    room: int


def new_room() -> int:
    """A random 63-bit bootstrap_room (unguessable, so rooms cannot be hijacked)."""
    return secrets.randbits(ROOM_BITS)


def choose_pair(
    prefill: WorkerPool,
    decode: WorkerPool,
    prefill_policy: Policy,
    decode_policy: Policy,
    *,
    avoid: Pair | None = None,
    max_in_flight: int = 0,
    key: RoutingKey | None = None,
) -> Pair:
    """A healthy prefill and decode worker and a fresh room; a retry passes the failed pair
    as `avoid` so it lands elsewhere where another healthy worker exists. With
    `max_in_flight` > 0 only workers with fewer requests in flight than that are chosen
    (WorkersBusy when none is left). `key` is the request's routing key, for cache-aware
    policies."""
    prefill_up = available(prefill, max_in_flight)
    decode_up = available(decode, max_in_flight)
    exclude_p = [avoid.prefill] if avoid else []
    exclude_d = [avoid.decode] if avoid else []
    return Pair(
        prefill=prefill_policy.choose(prefill_up, exclude=exclude_p, key=key),
        decode=decode_policy.choose(decode_up, exclude=exclude_d, key=key),
        room=new_room(),
    )


def accepted(
    pair: Pair, prefill_policy: Policy, decode_policy: Policy, key: RoutingKey | None
) -> None:
    """The pair's room opened: both policies remember the key for their worker."""
    prefill_policy.accepted(pair.prefill, key)
    decode_policy.accepted(pair.decode, key)


def available(pool: WorkerPool, max_in_flight: int) -> list[Worker]:
    """The pool's healthy workers with room for one more request (`max_in_flight` > 0);
    raises NoHealthyWorker or WorkersBusy."""
    healthy = pool.healthy()
    if not healthy:
        raise NoHealthyWorker(f"no healthy {pool.role.value} worker")
    if max_in_flight <= 0:
        return healthy
    free = [w for w in healthy if w.in_flight < max_in_flight]
    if not free:
        raise WorkersBusy(
            f"all {len(healthy)} {pool.role.value} worker(s) have {max_in_flight} requests "
            "in flight (--max-requests-per-worker); retry later"
        )
    return free


def with_bootstrap(body: dict[str, Any], pair: Pair) -> dict[str, Any]:
    """The request body for both legs: the client's body plus the bootstrap fields."""
    if pair.prefill.bootstrap_port is None:
        raise ValueError(f"prefill worker {pair.prefill.url} has no bootstrap port")
    return {
        **body,
        "bootstrap_host": pair.prefill.bootstrap_host,
        "bootstrap_port": pair.prefill.bootstrap_port,
        "bootstrap_room": pair.room,
    }
