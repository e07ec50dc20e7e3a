"""Pairing a prefill and a decode worker for one request, and the bootstrap fields that tell
both of them about each other (SGLang's PD protocol: same body to both). Torch-free."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from pdserve.router.policies import Policy
from pdserve.router.workers import NoHealthyWorker, Worker, WorkerPool

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
) -> Pair:
    """A healthy prefill and decode worker and a fresh room; a retry passes the failed pair
    as `avoid` so it lands elsewhere where another healthy worker exists."""
    prefill_up, decode_up = prefill.healthy(), decode.healthy()
    if not prefill_up:
        raise NoHealthyWorker("no healthy prefill worker")
    if not decode_up:
        raise NoHealthyWorker("no healthy decode worker")
    exclude_p = [avoid.prefill] if avoid else []
    exclude_d = [avoid.decode] if avoid else []
    return Pair(
        prefill=prefill_policy.choose(prefill_up, exclude=exclude_p),
        decode=decode_policy.choose(decode_up, exclude=exclude_d),
        room=new_room(),
    )


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
