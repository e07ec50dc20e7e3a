"""Where a part of a request goes (`fanout`): a prefill/decode pair (disaggregated mode, one
room per part), or one colocated worker (`--worker-urls`). Each route picks its workers and
opens the part on them; the proxy does the
rest the same way for both (retries, deadlines, relaying, access lines). Torch-free.

Disaggregated (docs/architecture/request-flow.md): both legs get the same body plus the bootstrap
fields and run concurrently; the client gets the decode leg's answer. The prefill leg is sent
without streaming so that its status tells whether the KV handoff succeeded (it ends when the
room does). When one leg fails the other is cancelled (closing its connection aborts it on
the worker, which frees its pages), and a worker whose leg was cut before it went out is told
by room (`POST /abort_room`).

Colocated: the body goes as it is to one `pdserve serve` worker, which runs prompt lists and
n > 1 itself; closing the connection aborts the request there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from pdserve.router.config import RouterConfig
from pdserve.router.errors import LegError
from pdserve.router.fanout import Part, split
from pdserve.router.legs import Answer, Legs
from pdserve.router.pairing import Pair, accepted, available, choose_pair, with_bootstrap
from pdserve.router.policies import CacheAwareSettings, make_policy
from pdserve.router.prefix_index import RoutingKey
from pdserve.router.workers import Worker, WorkerPool


def _settings(config: RouterConfig) -> CacheAwareSettings:
    return CacheAwareSettings(
        config.cache_threshold, config.balance_abs_threshold, config.balance_rel_threshold
    )


def _timed_out() -> LegError:
    return LegError("router", 504, None, "request timed out", retryable=False)


class PairRoute:
    """Disaggregated mode: each part on a prefill/decode pair, in a room of its own."""

    def __init__(self, config: RouterConfig, legs: Legs, prefill: WorkerPool, decode: WorkerPool):
        self.config = config
        self.legs = legs
        self.prefill = prefill
        self.decode = decode
        self.prefill_policy = make_policy(config.prefill_policy, cache_aware=_settings(config))
        self.decode_policy = make_policy(config.decode_policy, cache_aware=_settings(config))

    def split(self, endpoint: str, body: dict) -> list[Part]:
        """One part per (prompt, choice) (`fanout.split`); raises TooManyParts."""
        limit = self.config.max_rooms_per_request
        return split(endpoint, body, limit, 2 * self.config.max_body_bytes)

    def choose(self, avoid: Pair | None, key: RoutingKey | None = None) -> Pair:
        return choose_pair(
            self.prefill,
            self.decode,
            self.prefill_policy,
            self.decode_policy,
            avoid=avoid,
            max_in_flight=self.config.max_requests_per_worker,
            key=key,
        )

    def accepted(self, pair: Pair, key: RoutingKey | None) -> None:
        """The room opened on `pair` (decode answered, so prefill's KV arrived)."""
        accepted(pair, self.prefill_policy, self.decode_policy, key)

    async def open(self, pair: Pair, endpoint, body, headers, stream, deadline) -> Answer:
        leg_body = with_bootstrap(body, pair)
        prefill_body = dict(leg_body)
        if stream:
            # NOTE: only a valid `stream` is overridden: a wrong one (e.g. "true") must reach
            # both workers, so that prefill refuses it too instead of starting the work.
            prefill_body["stream"] = False
            prefill_body.pop("stream_options", None)
        self.prefill.acquire(pair.prefill)
        self.decode.acquire(pair.decode)
        prefill = asyncio.create_task(
            self.legs.prefill(self.prefill, pair.prefill, endpoint, prefill_body, headers)
        )
        prefill.add_done_callback(lambda _: self.prefill.release(pair.prefill))
        decode = asyncio.create_task(
            self.legs.answer(self.decode, pair.decode, endpoint, leg_body, headers, stream)
        )
        try:
            pending = {prefill, decode}
            while True:
                remaining = deadline - time.monotonic()
                done, _ = await asyncio.wait(
                    pending, timeout=max(remaining, 0), return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    raise _timed_out()
                if decode in done:
                    response, head, chunks = decode.result()  # raises the decode leg's LegError
                    return Answer(
                        pair, pair.decode, self.decode, response, head, chunks, prefill, deadline
                    )
                prefill.result()  # raises the prefill leg's LegError; else wait for decode
                pending = {decode}
        except BaseException:
            legs = ((pair.prefill, prefill), (pair.decode, decode))
            cut = [worker for worker, leg in legs if not leg.done()]
            prefill.cancel()
            decode.cancel()
            with contextlib.suppress(BaseException):
                response, _, _ = await decode
                await response.aclose()
            self.decode.release(pair.decode)
            self.legs.abort_rooms(cut, leg_body, headers)
            raise


class WorkerRoute:
    """Colocated mode: each request, whole, on one worker."""

    def __init__(self, config: RouterConfig, legs: Legs, workers: WorkerPool):
        self.config = config
        self.legs = legs
        self.workers = workers
        self.policy = make_policy(config.policy, cache_aware=_settings(config))

    def split(self, endpoint: str, body: dict) -> list[Part]:
        return [Part(body, True)]  # NOTE: the worker splits prompt lists and n > 1 itself

    def choose(self, avoid: Worker | None, key: RoutingKey | None = None) -> Worker:
        candidates = available(self.workers, self.config.max_requests_per_worker)
        return self.policy.choose(candidates, exclude=[avoid] if avoid else [], key=key)

    def accepted(self, worker: Worker, key: RoutingKey | None) -> None:
        self.policy.accepted(worker, key)

    async def open(self, worker: Worker, endpoint, body, headers, stream, deadline) -> Answer:
        self.workers.acquire(worker)
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                answer = self.legs.answer(self.workers, worker, endpoint, body, headers, stream)
                response, head, chunks = await answer
        except TimeoutError:
            self.workers.release(worker)
            raise _timed_out() from None
        except BaseException:
            self.workers.release(worker)
            raise
        return Answer(worker, worker, self.workers, response, head, chunks)
