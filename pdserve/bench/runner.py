"""Driving a workload at a given load.

The unit of arrival is a conversation: its turns go one after another, each sent when the
previous answer is in (a single-request workload is one-turn conversations). Conversations
start on a seeded Poisson schedule of `request_rate` per second (exponential gaps; `inf`
starts them all at once), and at most `max_concurrency` are in flight; since a conversation
has one request in flight at a time, that caps requests in flight too. Fixed concurrency N is
rate `inf` with `max_concurrency` N. A request's clock starts when it is sent, after any wait
for a slot.

A run may have a deadline (seconds from its start): requests still in flight then are cut off
(their streams closed, which a server takes as an abort) and recorded as failed, and
conversations not yet started are recorded as not sent, so an overloaded run ends on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.bench.client import BenchClient, RequestRecord
from pdserve.bench.workloads import Conversation


@dataclass(frozen=True)
class Load:
    request_rate: float = math.inf  # conversations started per second
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request rate {self.request_rate}: must be > 0 (or inf)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency {self.max_concurrency}: must be >= 1")

    @property
    def label(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        cap = f", max concurrency {self.max_concurrency}" if self.max_concurrency else ""
        return f"rate {rate}/s{cap}"


@dataclass
class RunResult:
    load: Load
    records: list[RequestRecord]  # by (conversation, turn)
    duration_s: float  # from the run's start until its last request ended


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Start times (s) of `count` arrivals of a Poisson process of `rate` per second: the
    first at 0, then exponential gaps of mean 1/rate. All 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


async def run_load(
    client: BenchClient,
    conversations: list[Conversation],
    load: Load,
    seed: int = 0,
    on_record: Callable[[RequestRecord], None] | None = None,
    deadline_s: float | None = None,
) -> RunResult:
    """Every turn of every conversation at `load`; `on_record` sees each record as it ends.
    A failed turn ends its conversation: the turns after it are recorded as failed, unsent.
    `deadline_s`: seconds from the start after which the run is cut off (module docstring)."""
    offsets = arrival_offsets(len(conversations), load.request_rate, seed)
    start = time.perf_counter()
    scheduled = [
        (i, c, offset) for i, (c, offset) in enumerate(zip(conversations, offsets, strict=True))
    ]
    records = await run_scheduled(client, scheduled, load, start, on_record, deadline_s)
    return RunResult(load, records, time.perf_counter() - start)


async def run_scheduled(
    client: BenchClient,
    scheduled: list[tuple[int, Conversation, float]],
    load: Load,
    start: float,
    on_record: Callable[[RequestRecord], None] | None = None,
    deadline_s: float | None = None,
) -> list[RequestRecord]:
    """`run_load`'s work: each (index, conversation, offset) started `offset` s after
    `start` (a `time.perf_counter()` reading); its records sorted."""
    if deadline_s is not None and not deadline_s > 0:
        raise ValueError(f"deadline {deadline_s} s: must be > 0")
    records: list[RequestRecord] = []
    gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None

    def keep(record: RequestRecord) -> None:
        records.append(record)
        if on_record is not None:
            on_record(record)

    async def converse(index: int, conversation: Conversation, offset: float) -> None:
        answers: list[str] = []
        sent: float | None = None  # when the turn in flight was sent
        left = None if deadline_s is None else start + deadline_s - time.perf_counter()
        try:
            async with asyncio.timeout(left):
                await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
                async with gate or contextlib.nullcontext():
                    for turn in range(len(conversation.turns)):
                        sent = time.perf_counter() - start
                        record = await client.send(conversation, answers)
                        record.conversation, record.start_s = index, sent
                        keep(record)
                        if not record.success:
                            for later in range(turn + 1, len(conversation.turns)):
                                keep(_unsent(conversation, index, later, record.start_s))
                            return
                        answers.append(record.answer)
                        sent = None
        except TimeoutError:
            keep(_cut_off(conversation, index, len(answers), sent, deadline_s))
            for later in range(len(answers) + 1, len(conversation.turns)):
                keep(_unsent(conversation, index, later, deadline_s))

    await asyncio.gather(*(converse(*item) for item in scheduled))
    records.sort(key=lambda r: (r.conversation, r.turn))
    return records


async def warm_up(client: BenchClient, conversations: list[Conversation]) -> list[RequestRecord]:
    """The first turn of each conversation, one at a time, untimed by any summary."""
    return [await client.send(conversation, []) for conversation in conversations]


def _unsent(conversation: Conversation, index: int, turn: int, start_s: float) -> RequestRecord:
    return RequestRecord(
        conversation=index,
        turn=turn,
        max_tokens=conversation.turns[turn].max_tokens,
        error="not sent: an earlier turn of its conversation failed",
        start_s=start_s,
    )


def _cut_off(
    conversation: Conversation, index: int, turn: int, sent: float | None, deadline_s: float
) -> RequestRecord:
    """The turn in flight (or not yet sent) when the run's deadline passed."""
    if sent is None:
        error = f"not sent: the run's deadline ({deadline_s:g} s) came first"
    else:
        error = f"cut off at the run's deadline ({deadline_s:g} s), unfinished"
    return RequestRecord(
        conversation=index,
        turn=turn,
        max_tokens=conversation.turns[turn].max_tokens,
        error=error,
        start_s=deadline_s if sent is None else sent,
        e2e_s=None if sent is None else deadline_s - sent,
    )
