"""One client request across a prefill/decode pair (SGLang's PD protocol, docs/architecture.md §2).

Both legs get the same body plus the bootstrap fields and run concurrently; the client gets
the decode leg's response, streamed when asked. The prefill leg is sent without streaming so
that its status tells whether the KV handoff succeeded (it ends when the room does).

Failure rules: when one leg fails, the other is cancelled (closing its connection aborts it on
the worker, which frees its pages). A failure that a new pair may fix is retried once with a
new pair and room, but only while nothing was sent to the client; a stream that breaks later
ends with an SSE error event. Which failures those are, a worker's error says by its `code`, a
FailureKind whose entry in protocol/failures.py's table gives the status and the retry; an
error without one is retried when it is a 5xx (a worker unreachable or failed), and a 4xx (the
request's, or, 429, a full worker's answer) is passed on as it is. A request that outlives
`request_timeout_s` fails with 504. A client that disconnects, at any point, cancels both legs.

Connections: a pooled keep-alive connection the worker already closed fails before any
response byte; the leg is sent once more on a new connection before that counts as a failure,
and a worker leaves rotation only after `health_failure_threshold` failures in a row (a good
health check or request resets the count), never for one transient error. Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx
from fastapi.responses import Response, StreamingResponse

from pdserve.protocol.log_limit import RateLimitedLog
from pdserve.router.access_log import AccessRecord
from pdserve.router.config import RouterConfig
from pdserve.router.errors import (
    LegError,
    error_event,
    error_response,
    leg_error,
    raise_if_error_event,
)
from pdserve.router.fanout import (
    DONE,
    SSE_EVENT_END,
    BadAnswer,
    RoomFailed,
    StreamMerge,
    TooManyRooms,
    merge_bodies,
    split,
)
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pairing import Pair, choose_pair, with_bootstrap
from pdserve.router.policies import make_policy
from pdserve.router.workers import NoHealthyWorker, Worker, WorkerPool, WorkersBusy

logger = logging.getLogger(__name__)

MAX_FIRST_EVENT_BYTES = 1 << 20
# NOTE: what a pooled connection the worker had closed fails with (EOF or reset before any
# response byte, or a broken pipe while sending); not ConnectError: nothing listens there.
STALE_CONNECTION_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


@dataclass
class _Legs:
    """An attempt whose decode leg answered: what to relay, and what to clean up."""

    pair: Pair
    prefill: asyncio.Task
    decode: httpx.Response
    head: bytes  # the first SSE event (stream) or the whole body
    chunks: AsyncIterator[bytes] | None = None


class Proxy:
    def __init__(
        self,
        config: RouterConfig,
        prefill: WorkerPool,
        decode: WorkerPool,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        fresh_client: httpx.AsyncClient | None = None,
    ):
        """client: pooled keep-alive connections to the workers; fresh_client: a new
        connection per request, for sending a leg again after a stale one failed."""
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self.client = client
        self.fresh_client = fresh_client or client
        self.metrics = metrics
        self.prefill_policy = make_policy(config.prefill_policy)
        self.decode_policy = make_policy(config.decode_policy)
        self.leg_warnings = RateLimitedLog(logger, per_second=0.1, burst=1)
        self.client_errors = RateLimitedLog(logger, per_second=1.0, burst=5)
        self._background: set[asyncio.Task] = set()  # room aborts under way

    async def handle(
        self,
        endpoint: str,
        body: dict,
        headers: dict[str, str],
        client_left: Callable[[], Awaitable[None]],
        access: AccessRecord,
    ) -> Response:
        """client_left: returns when the client closes its connection; access: where the
        request's pairs, retries and answer bytes are noted for its access line."""
        started = time.monotonic()
        deadline = started + self.config.request_timeout_s
        stream = body.get("stream") is True
        try:
            parts = split(
                endpoint, body, self.config.max_rooms_per_request, 2 * self.config.max_body_bytes
            )
        except TooManyRooms as e:
            code = "too_many_rooms" if e.status == 400 else "body_too_large"
            response = error_response(e.status, str(e), code, _reply(headers), e.param)
            return self._done(endpoint, started, response)
        bodies = [part.body for part in parts]
        access.rooms = len(bodies)
        attempt = asyncio.ensure_future(
            self._open_all(endpoint, bodies, headers, stream, deadline, access)
        )
        # NOTE: until the first byte, the client leaving is watched here (streaming or not):
        # every room's legs are cancelled, which aborts them on the workers; once a stream
        # has started, the streaming response notices.
        watcher = asyncio.ensure_future(client_left())
        try:
            await asyncio.wait({attempt, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not attempt.done():
                attempt.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await attempt
        if attempt.cancelled():
            return self._done(endpoint, started, Response(status_code=499))
        rooms = attempt.result()
        if isinstance(rooms, Response):
            return self._done(endpoint, started, rooms)
        if stream:
            if len(rooms) == 1:
                relay = self._relay(endpoint, rooms[0], deadline, started, access)
            else:
                merge = StreamMerge(endpoint, parts)
                relay = self._relay_merged(endpoint, rooms, merge, deadline, started, access)
            return StreamingResponse(relay, media_type="text/event-stream", headers=_reply(headers))
        await self._close_all(rooms)
        if len(rooms) == 1:
            content = rooms[0].head
        else:
            try:
                content = merge_bodies(endpoint, parts, [legs.head for legs in rooms])
            except BadAnswer as e:
                response = error_response(502, str(e), "worker_failed", _reply(headers))
                return self._done(endpoint, started, response)
        for room, legs in enumerate(rooms):
            access.saw(room, legs.head)
        response = Response(content, media_type="application/json", headers=_reply(headers))
        return self._done(endpoint, started, response)

    def _done(self, endpoint: str, started: float, response: Response) -> Response:
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        self.metrics.latency.labels(endpoint).observe(time.monotonic() - started)
        return response

    # ---- attempts --------------------------------------------------------------------

    async def _open_all(
        self, endpoint, bodies, headers, stream, deadline, access
    ) -> list[_Legs] | Response:
        """Open every room of a request at once: all their legs, or the first room's error
        that no retry fixed (every other room is then closed or cancelled, which aborts it on
        its workers)."""
        rooms = [
            asyncio.ensure_future(
                self._attempts(endpoint, body, headers, stream, deadline, access, room)
            )
            for room, body in enumerate(bodies)
        ]
        opened = False
        try:
            for next_room in asyncio.as_completed(rooms):
                result = await next_room
                if isinstance(result, Response):
                    return result
            opened = True
            return [room.result() for room in rooms]
        finally:
            if not opened:
                await asyncio.shield(self._discard(rooms))

    async def _discard(self, rooms: list[asyncio.Future]) -> None:
        """Cancel the rooms still opening and close the ones that opened."""
        for room in rooms:
            room.cancel()
        results = await asyncio.gather(*rooms, return_exceptions=True)
        await self._close_all([r for r in results if isinstance(r, _Legs)])

    async def _attempts(
        self, endpoint, body, headers, stream, deadline, access: AccessRecord, room: int
    ) -> _Legs | Response:
        """Open room `room`'s legs on a pair; retry once on a new pair if that may help."""
        avoid = None
        for attempt in range(self.config.max_retries + 1):
            try:
                pair = choose_pair(
                    self.prefill,
                    self.decode,
                    self.prefill_policy,
                    self.decode_policy,
                    avoid=avoid,
                    max_in_flight=self.config.max_requests_per_worker,
                )
            except NoHealthyWorker as e:
                return error_response(503, str(e), "no_healthy_worker", _reply(headers))
            except WorkersBusy as e:
                busy = {**_reply(headers), "Retry-After": "1"}
                return error_response(429, str(e), "rate_limit_exceeded", busy)
            access.paired(room, pair)
            try:
                return await self._open(pair, endpoint, body, headers, stream, deadline)
            except LegError as e:
                request_id = headers.get("X-Request-Id")
                if e.status < 500:
                    # NOTE: the request's own answer (invalid, or a full worker's 429): no
                    # worker failed; requests_total counts it by status.
                    self.client_errors.info("request %s: %s", request_id, e, key=e.status)
                else:
                    self.metrics.leg_failures.labels(e.role, str(e.status)).inc()
                    self.leg_warnings.warning(
                        "request %s: %s", request_id, e, key=(e.role, e.status)
                    )
                if not e.retryable or attempt == self.config.max_retries:
                    return e.response(_reply(headers))
                if time.monotonic() >= deadline:
                    return error_response(504, "request timed out", "timeout", _reply(headers))
                self.metrics.retries.inc()
                access.retries += 1
                avoid = pair
        raise AssertionError("unreachable")

    async def _open(self, pair: Pair, endpoint, body, headers, stream, deadline) -> _Legs:
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
            self._prefill_leg(pair.prefill, endpoint, prefill_body, headers)
        )
        prefill.add_done_callback(lambda _: self.prefill.release(pair.prefill))
        decode = asyncio.create_task(
            self._decode_leg(pair.decode, endpoint, leg_body, headers, stream)
        )
        try:
            pending = {prefill, decode}
            while True:
                remaining = deadline - time.monotonic()
                done, _ = await asyncio.wait(
                    pending, timeout=max(remaining, 0), return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    raise LegError("router", 504, None, "request timed out", retryable=False)
                if decode in done:
                    response, head, chunks = decode.result()  # raises the decode leg's LegError
                    return _Legs(pair, prefill, response, head, chunks)
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
            self._abort_rooms(cut, leg_body, headers)
            raise

    def _abort_rooms(self, workers: list[Worker], leg_body: dict, headers) -> None:
        """Tell the workers whose legs were cut off to end the room, in the background.

        NOTE: closing a leg's connection aborts it only on a worker that got it: a leg cut
        before it went out never arrives, while the peer's transfer request for its room does
        and would hold the other worker's room (and pages) until the transfer deadline."""
        room = {k: leg_body[k] for k in ("bootstrap_room", "bootstrap_host", "bootstrap_port")}
        for worker in workers:
            task = asyncio.ensure_future(self._abort_room(worker, room, headers))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _abort_room(self, worker: Worker, room: dict, headers) -> None:
        try:
            await self.client.post(
                worker.url + "/abort_room",
                json=room,
                headers=headers,
                timeout=self.config.connect_timeout_s,
            )
        except httpx.HTTPError as e:
            logger.info("could not abort room %s on %s: %s", room["bootstrap_room"], worker.url, e)

    async def _send(self, pool: WorkerPool, worker: Worker, endpoint, body, headers):
        """Send one leg; its response with the body still to read. A pooled connection the
        worker had closed (after its keep-alive timeout, or an error) fails before any byte
        of response: the leg goes once more, on a new connection, before that counts."""
        request = self.client.build_request(
            "POST", worker.url + endpoint, json=body, headers=headers
        )
        try:
            try:
                response = await self.client.send(request, stream=True)
            except STALE_CONNECTION_ERRORS:
                response = await self.fresh_client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise self._unreachable(pool.role.value, pool, worker, e) from None
        pool.note_success(worker)
        return response

    async def _prefill_leg(self, worker: Worker, endpoint, body, headers) -> None:
        response = await self._send(self.prefill, worker, endpoint, body, headers)
        try:
            content = await response.aread()
        except httpx.HTTPError as e:
            raise self._unreachable("prefill", self.prefill, worker, e) from None
        finally:
            await response.aclose()
        if response.status_code != 200:
            raise leg_error("prefill", response.status_code, content)

    async def _decode_leg(self, worker: Worker, endpoint, body, headers, stream):
        response = await self._send(self.decode, worker, endpoint, body, headers)
        try:
            if response.status_code != 200:
                raise leg_error("decode", response.status_code, await response.aread())
            if not stream:
                return response, await response.aread(), None
            chunks = response.aiter_bytes()
            head = b""
            async for chunk in chunks:
                head += chunk
                if SSE_EVENT_END in head or len(head) > MAX_FIRST_EVENT_BYTES:
                    break
            raise_if_error_event("decode", head)
            return response, head, chunks
        except httpx.HTTPError as e:
            await response.aclose()
            raise self._unreachable("decode", self.decode, worker, e) from None
        except BaseException:
            await response.aclose()
            raise

    def _unreachable(self, role: str, pool: WorkerPool, worker: Worker, error) -> LegError:
        """A worker we could not talk to: one failure more in a row (`note_failure`); enough
        of them take it out of rotation, a good health check brings it back."""
        reason = f"{worker.url} unreachable: {type(error).__name__}: {error}".rstrip(": ")
        if pool.note_failure(worker, reason, self.config.health_failure_threshold):
            logger.warning("%s worker out of rotation: %s", role, reason)
        return LegError(role, 502, None, reason, retryable=True)

    # ---- streaming -------------------------------------------------------------------

    async def _relay(
        self, endpoint, legs: _Legs, deadline, started, access: AccessRecord
    ) -> AsyncIterator[bytes]:
        """The decode leg's stream, as it comes; an SSE error event if it breaks."""
        status = "200"
        self.metrics.first_byte.labels(endpoint).observe(time.monotonic() - started)
        try:
            access.saw(0, legs.head)
            yield legs.head
            async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                async for chunk in legs.chunks:
                    access.saw(0, chunk)
                    yield chunk
        except TimeoutError:
            status = "504"
            yield error_event(504, "request timed out while streaming", "timeout")
            yield b"data: [DONE]\n\n"
        except httpx.HTTPError as e:
            status = "502"
            self._unreachable("decode", self.decode, legs.pair.decode, e)
            reason = f"{type(e).__name__}: {e}".rstrip(": ")
            message = f"the decode worker failed mid-stream ({reason})"
            yield error_event(502, message, "worker_failed")
            yield b"data: [DONE]\n\n"
        finally:
            access.stream_error = None if status == "200" else status
            self.metrics.requests.labels(endpoint, status).inc()
            self.metrics.latency.labels(endpoint).observe(time.monotonic() - started)
            # NOTE: shielded: a client that left cancels this generator, and the cleanup
            # (closing the decode leg aborts it on the worker) must still run to the end.
            await asyncio.shield(self._close(legs))

    async def _relay_merged(
        self, endpoint, rooms: list[_Legs], merge: StreamMerge, deadline, started, access
    ) -> AsyncIterator[bytes]:
        """The rooms' streams as one (`fanout.StreamMerge`); when one room fails, the stream
        ends with its error and every other room is closed (aborted on its workers)."""
        status = "200"
        self.metrics.first_byte.labels(endpoint).observe(time.monotonic() - started)
        # NOTE: bounded, so a slow client holds the rooms back instead of filling memory.
        queue: asyncio.Queue = asyncio.Queue(maxsize=4 * len(rooms))

        async def pump(index: int, legs: _Legs) -> None:
            """The room's bytes, then None when its stream ends (or the error it ended with)."""
            try:
                await queue.put((index, legs.head))
                async for chunk in legs.chunks:
                    await queue.put((index, chunk))
                await queue.put((index, None))
            except httpx.HTTPError as e:
                await queue.put((index, e))

        pumps = [asyncio.ensure_future(pump(i, legs)) for i, legs in enumerate(rooms)]
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                while not merge.done:
                    index, item = await queue.get()
                    if isinstance(item, httpx.HTTPError):
                        status = "502"
                        self._unreachable("decode", self.decode, rooms[index].pair.decode, item)
                        reason = f"{type(item).__name__}: {item}".rstrip(": ")
                        message = f"a decode worker failed mid-stream ({reason})"
                        yield error_event(502, message, "worker_failed") + DONE
                        return
                    if item is None:
                        if merge.finished(index):
                            continue
                        status = "502"
                        message = "a decode worker ended its stream without [DONE]"
                        yield error_event(502, message, "worker_failed") + DONE
                        return
                    access.saw(index, item)
                    try:
                        events = merge.feed(index, item)
                    except RoomFailed as e:
                        status = str(e.status)
                        yield e.event + DONE
                        return
                    except BadAnswer as e:
                        status = "502"
                        yield error_event(502, str(e), "worker_failed") + DONE
                        return
                    if events:
                        yield events
            yield merge.end()
        except TimeoutError:
            status = "504"
            yield error_event(504, "request timed out while streaming", "timeout") + DONE
        finally:
            for task in pumps:
                task.cancel()
            access.stream_error = None if status == "200" else status
            self.metrics.requests.labels(endpoint, status).inc()
            self.metrics.latency.labels(endpoint).observe(time.monotonic() - started)
            await asyncio.shield(self._close_all(rooms))

    async def _close_all(self, rooms: list[_Legs]) -> None:
        await asyncio.gather(*(self._close(legs) for legs in rooms))

    async def _close(self, legs: _Legs) -> None:
        self.decode.release(legs.pair.decode)
        if not legs.prefill.done():
            # NOTE: decode has the first token, so the room succeeded: prefill's answer is
            # only its bookkeeping; don't hold the client for it.
            legs.prefill.cancel()
        await legs.decode.aclose()
        with contextlib.suppress(BaseException):
            await legs.prefill


def _reply(headers: dict[str, str]) -> dict[str, str]:
    """Response headers: the request id only (never echo the client's credentials)."""
    return {"X-Request-Id": headers["X-Request-Id"]}
