"""How the router talks to a worker for one room: sending a leg, reading the answering worker's
status and first SSE event, counting failures against a worker, and ending a room. Torch-free.

Legs go through a LegClient: `http1.Http1Pool` (a lean HTTP/1.1 client: the legs are the
router's hot path), or httpx transports (`TransportLegClient`, for tests' fake workers).
Either way a worker's answer arrives as it sent it (no Accept-Encoding goes out, so nothing
comes back compressed), ready to be passed on byte for byte.

Connections: a pooled keep-alive connection the worker already closed fails before any
response byte; the leg is sent once more on a new connection before that counts as a failure,
and a worker leaves rotation only after `health_failure_threshold` failures in a row (a good
health check or request resets the count), never for one transient error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import httpx

from pdserve.router.config import RouterConfig
from pdserve.router.errors import LegError, leg_error, raise_if_error_event
from pdserve.router.fanout import SSE_EVENT_END
from pdserve.router.pairing import Pair
from pdserve.router.workers import Worker, WorkerPool

logger = logging.getLogger(__name__)

MAX_FIRST_EVENT_BYTES = 1 << 20
# NOTE: what a pooled connection the worker had closed fails with (EOF or reset before any
# response byte, or a broken pipe while sending); not ConnectError: nothing listens there.
STALE_CONNECTION_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
ROOM_FIELDS = ("bootstrap_room", "bootstrap_host", "bootstrap_port")


@dataclass
class Answer:
    """A room whose answering leg (the decode worker, or a colocated one) responded: what to
    relay to the client, and what to close once it is relayed."""

    route: Pair | Worker
    worker: Worker  # whose answer the client gets
    pool: WorkerPool
    response: LegResponse
    head: bytes  # a stream's first SSE event, or the whole answer
    chunks: AsyncIterator[bytes] | None = None  # a stream's bytes after `head`
    prefill: asyncio.Task | None = None  # the prefill leg, still running or done
    deadline: float = math.inf  # the request's (time.monotonic)

    def finished(self) -> bool:
        """Whether the answering worker's answer was read to its end (`http1` answers say;
        others are taken as not)."""
        return getattr(self.response, "complete", False)


class LegResponse(Protocol):
    """A worker's answer to a leg, its body still to read (`http1.Http1Response`, or an
    httpx.Response from a transport)."""

    status_code: int
    stream: AsyncIterable[bytes]

    async def aread(self) -> bytes: ...

    async def aclose(self) -> None: ...


class LegClient(Protocol):
    """How legs reach workers: POST a JSON body; raises httpx.HTTPError for a worker that
    could not be reached (a stale kept-alive connection is no such failure: it is retried on
    a new connection inside)."""

    async def post(self, url: str, content: bytes, headers: dict[str, str]) -> LegResponse: ...

    def cut_worker(self, url: str) -> int:
        """Close the connections to a worker that stopped answering (legs on them fail)."""
        ...

    async def aclose(self) -> None: ...


class TransportLegClient:
    """Legs through httpx transports: `transport` pooled, `fresh_transport` a new connection
    per request (tests give one fake transport for both)."""

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport,
        fresh_transport: httpx.AsyncBaseTransport,
        timeout: httpx.Timeout,
    ):
        self.transport = transport
        self.fresh_transport = fresh_transport
        self.timeout = timeout.as_dict()

    async def post(self, url: str, content: bytes, headers: dict[str, str]) -> httpx.Response:
        request = httpx.Request(
            "POST", url, content=content, headers=headers, extensions={"timeout": self.timeout}
        )
        try:
            return await self.transport.handle_async_request(request)
        except STALE_CONNECTION_ERRORS:
            return await self.fresh_transport.handle_async_request(request)

    def cut_worker(self, url: str) -> int:
        return 0  # NOTE: a transport's connections are its own

    async def aclose(self) -> None:
        pass  # NOTE: the transports belong to whoever made them


class Legs:
    """The legs of every room, and what still runs for rooms already closed."""

    def __init__(self, config: RouterConfig, client: LegClient):
        self.config = config
        self.client = client
        self._background: set[asyncio.Future] = set()  # room aborts, prefill answers

    async def send(self, pool: WorkerPool, worker: Worker, path: str, body: dict, headers):
        """Send one leg; its response with the body still to read."""
        content = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        try:
            response = await self.client.post(
                worker.url + path, content, {**headers, "Content-Type": "application/json"}
            )
        except httpx.HTTPError as e:
            raise self.unreachable(pool, worker, e) from None
        pool.note_success(worker)
        return response

    async def answer(
        self, pool: WorkerPool, worker: Worker, path: str, body: dict, headers, stream: bool
    ) -> tuple[LegResponse, bytes, AsyncIterator[bytes] | None]:
        """The answering leg: (response, head, the rest of a stream). Raises LegError for an
        error status, or a stream whose first event is an error: nothing was sent yet."""
        response = await self.send(pool, worker, path, body, headers)
        try:
            if response.status_code != 200:
                raise leg_error(pool.role.value, response.status_code, await response.aread())
            if not stream:
                return response, await response.aread(), None
            chunks = aiter(response.stream)
            head = b""
            async for chunk in chunks:
                head += chunk
                if SSE_EVENT_END in head or len(head) > MAX_FIRST_EVENT_BYTES:
                    break
            raise_if_error_event(pool.role.value, head)
            return response, head, chunks
        except httpx.HTTPError as e:
            await response.aclose()
            raise self.unreachable(pool, worker, e) from None
        except BaseException:
            await response.aclose()
            raise

    async def prefill(self, pool: WorkerPool, worker: Worker, path: str, body: dict, headers):
        """The prefill leg: returns when it succeeded (its room's KV went out), else raises
        LegError."""
        response = await self.send(pool, worker, path, body, headers)
        try:
            content = await response.aread()
        except httpx.HTTPError as e:
            raise self.unreachable(pool, worker, e) from None
        finally:
            await response.aclose()
        if response.status_code != 200:
            raise leg_error(pool.role.value, response.status_code, content)

    def cut(self, worker: Worker) -> None:
        """`worker` accepts connections but answers nothing (its health checks time out):
        end the legs on it now rather than at their deadline. Those with nothing relayed yet
        are retried on another worker; a started stream ends with an error event."""
        if count := self.client.cut_worker(worker.url):
            logger.warning("%s stopped answering: %d connections to it cut", worker.url, count)

    def unreachable(self, pool: WorkerPool, worker: Worker, error: Exception) -> LegError:
        """A worker we could not talk to: one failure more in a row (`note_failure`); enough
        of them take it out of rotation, a good health check brings it back."""
        reason = f"{worker.url} unreachable: {type(error).__name__}: {error}".rstrip(": ")
        if pool.note_failure(worker, reason, self.config.health_failure_threshold):
            logger.warning("%s worker out of rotation: %s", pool.role.value, reason)
        return LegError(pool.role.value, 502, None, reason, retryable=True)

    async def close(self, answer: Answer) -> None:
        """End a room that answered: its connections closed (which aborts what still runs on
        the workers), its worker released."""
        answer.pool.release(answer.worker)
        prefill = answer.prefill
        if prefill is not None and prefill.done():
            self._forget(prefill)  # NOTE: how it ended no longer matters
        elif prefill is not None:
            # NOTE: decode answered, so the room's KV arrived: prefill's answer is only its
            # bookkeeping, and the client is not held for it. It finishes in the background
            # by the request's deadline: cut, the prefill worker would abort a room that
            # succeeded (counted as an abort there) and its connection would be lost (a new
            # one for the next prefill leg). A prefill worker ends its rooms within its own
            # --transfer-timeout, so this is rarely the bound that applies.
            self._keep(prefill)
            remaining = max(answer.deadline - time.monotonic(), 0)
            if remaining != math.inf:
                timer = asyncio.get_running_loop().call_later(remaining, prefill.cancel)
                prefill.add_done_callback(lambda _: timer.cancel())
        await answer.response.aclose()

    def abort_rooms(self, workers: list[Worker], leg_body: dict, headers) -> None:
        """Tell the workers whose legs were cut off to end the room, in the background.

        NOTE: closing a leg's connection aborts it only on a worker that got it: a leg cut
        before it went out never arrives, while the peer's transfer request for its room does
        and would hold the other worker's room (and pages) until the transfer deadline."""
        room = {field: leg_body[field] for field in ROOM_FIELDS}
        for worker in workers:
            self._keep(asyncio.ensure_future(self._abort_room(worker, room, headers)))

    def _keep(self, task: asyncio.Future) -> None:
        """Hold a task running in the background until it ends (or `aclose`); how it ended
        no longer matters to anyone."""
        self._background.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Future) -> None:
        self._background.discard(task)
        if not task.cancelled():
            task.exception()  # NOTE: retrieved, so that asyncio does not log it

    async def aclose(self) -> None:
        """End what still runs in the background and close the connections (the router is
        stopping)."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.client.aclose()

    async def _abort_room(self, worker: Worker, room: dict, headers) -> None:
        content = json.dumps(room).encode()
        headers = {**headers, "Content-Type": "application/json"}
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                response = await self.client.post(worker.url + "/abort_room", content, headers)
                await response.aread()
                await response.aclose()
        except (httpx.HTTPError, TimeoutError) as e:
            logger.info("could not abort room %s on %s: %s", room["bootstrap_room"], worker.url, e)
