"""Relaying answered parts' streams to the client. Torch-free.

One part (one prompt, n = 1: nearly every request) is passed through byte for byte as the
worker's chunks arrive. The router reads nothing in it: the part's first event was already
read to open it (an error there fails the attempt, which may still be retried since nothing
was sent), and an error event the worker ends a started stream with goes to the client as it
is (the access line finds it in the last chunks). What the router adds is its own ending: an
SSE error event and `[DONE]` when the worker's connection breaks or the request's deadline
passes, or when the router is shutting down and the stream still runs at the shutdown timeout
(`end_streams`: each stream's deadline is brought forward to now).

Several parts (`fanout`) must be rewritten into one stream (choices renumbered, one id, usage
summed), so their events are parsed (`fanout.StreamMerge`); one part failing ends the stream
with its error and every other part is closed.

Either way the parts are closed when the stream ends, however it ends: a client that leaves
cancels the relay, and closing the legs' connections aborts them on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import httpx
from starlette.types import Receive, Scope, Send

from pdserve.router.access_log import AccessRecord
from pdserve.router.errors import error_event
from pdserve.router.fanout import DONE, BadAnswer, RoomFailed, StreamMerge
from pdserve.router.intake import ClientWatch
from pdserve.router.legs import Answer, Legs
from pdserve.router.metrics import RouterMetrics


class Relay:
    def __init__(self, legs: Legs, metrics: RouterMetrics):
        self.legs = legs
        self.metrics = metrics
        # The deadlines of the streams being relayed, and why they were ended early (if so).
        self._deadlines: set[asyncio.Timeout] = set()
        self.ending: str | None = None

    def end_streams(self, reason: str) -> None:
        """End every stream being relayed, and any that starts later, with a 503 error event
        saying `reason` and `[DONE]` (its parts are closed, which aborts them)."""
        self.ending = reason
        now = asyncio.get_running_loop().time()
        for deadline in self._deadlines:
            deadline.reschedule(now)

    @contextlib.contextmanager
    def _watched(self, deadline: asyncio.Timeout):
        if self.ending is not None:
            deadline.reschedule(asyncio.get_running_loop().time())
        self._deadlines.add(deadline)
        try:
            yield
        finally:
            self._deadlines.discard(deadline)

    def _timed_out(self) -> tuple[str, bytes]:
        """(status, the stream's last bytes) for a stream whose deadline passed."""
        if self.ending is not None:
            return "503", error_event(503, self.ending, "unavailable") + DONE
        return "504", error_event(504, "request timed out while streaming", "timeout") + DONE

    async def one(
        self, endpoint: str, answer: Answer, deadline: float, started: float, access: AccessRecord
    ) -> AsyncIterator[bytes]:
        """The answering worker's stream, as it comes; an SSE error event if it breaks."""
        status = "200"
        self.metrics.first_byte(endpoint, time.monotonic() - started)
        saw = access.saw
        try:
            try:
                saw(0, answer.head)
                yield answer.head
                if not answer.finished():  # NOTE: else nothing is left to wait for
                    async with asyncio.timeout(max(deadline - time.monotonic(), 0)) as timer:
                        with self._watched(timer):
                            async for chunk in answer.chunks:
                                saw(0, chunk)
                                yield chunk
            except TimeoutError:
                status, last = self._timed_out()
                yield last
            except httpx.HTTPError as e:
                status = "502"
                self.legs.unreachable(answer.pool, answer.worker, e)
                reason = f"{type(e).__name__}: {e}".rstrip(": ")
                message = f"the {answer.pool.role.value} worker failed mid-stream ({reason})"
                yield error_event(502, message, "worker_failed") + DONE
        except BaseException:
            # NOTE: cut short: the client left (its watch cancelled the task), or the stream
            # was closed. Shielded, so that the cleanup (closing the worker's leg aborts it
            # there) runs to the end even if the task is cancelled again.
            self._ended(endpoint, status, started, access)
            await asyncio.shield(self.legs.close(answer))
            raise
        self._ended(endpoint, status, started, access)
        await self.legs.close(answer)

    async def merged(
        self,
        endpoint: str,
        answers: list[Answer],
        merge: StreamMerge,
        deadline: float,
        started: float,
        access: AccessRecord,
    ) -> AsyncIterator[bytes]:
        """The parts' streams as one (`fanout.StreamMerge`); when one part fails, the stream
        ends with its error and every other part is closed (aborted on its workers)."""
        status = "200"
        self.metrics.first_byte(endpoint, time.monotonic() - started)
        # NOTE: bounded, so a slow client holds the parts back instead of filling memory.
        queue: asyncio.Queue = asyncio.Queue(maxsize=4 * len(answers))

        async def pump(index: int, answer: Answer) -> None:
            """The part's bytes, then None when its stream ends (or the error it ended with)."""
            try:
                await queue.put((index, answer.head))
                async for chunk in answer.chunks:
                    await queue.put((index, chunk))
                await queue.put((index, None))
            except httpx.HTTPError as e:
                await queue.put((index, e))

        pumps = [asyncio.ensure_future(pump(i, answer)) for i, answer in enumerate(answers)]
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0)) as timer:
                with self._watched(timer):
                    while not merge.done:
                        index, item = await queue.get()
                        if isinstance(item, httpx.HTTPError):
                            status = "502"
                            self.legs.unreachable(answers[index].pool, answers[index].worker, item)
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
            status, last = self._timed_out()
            yield last
        finally:
            for task in pumps:
                task.cancel()
            self._ended(endpoint, status, started, access)
            await asyncio.shield(self.close_all(answers))

    async def close_all(self, answers: list[Answer]) -> None:
        await asyncio.gather(*(self.legs.close(answer) for answer in answers))

    def _ended(self, endpoint: str, status: str, started: float, access: AccessRecord) -> None:
        access.stream_error = None if status == "200" else status
        self.metrics.ended(endpoint, status, time.monotonic() - started)


class EventStream:
    """A server-sent event stream: `events`' bytes as they come. Plain ASGI, nothing per chunk
    but the write. The client leaving is not watched here: the request's `ClientWatch`
    cancels the task that runs this, and closing `events` ends the parts; `watch` is stopped
    as the stream's end goes out.

    finished: whether the worker's answer behind `events` was read to its end (after which
    `events` gives nothing more). Once it was, the chunk `events` gave last goes out with the
    response's end, in one write (a short stream is often all there by the time the router
    has read its first event): one write and one pass through the server less; `events`
    then ends (its parts closed)."""

    status_code = 200

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        headers: dict[str, str],
        watch: ClientWatch,
        finished: Callable[[], bool] = lambda: False,
    ):
        self.events = events
        self.watch = watch
        self.finished = finished
        self.headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            *((name.lower().encode("latin-1"), value.encode("latin-1"))
              for name, value in headers.items()),
        ]  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        events = self.events
        try:
            # NOTE: `events` starts before anything is sent: a generator closed before its
            # start would skip its cleanup (the parts' legs left open).
            chunk = await anext(events, None)
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            while chunk is not None and not self.finished():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                chunk = await anext(events, None)
            self.watch.stop()
            await send({"type": "http.response.body", "body": chunk or b"", "more_body": False})
            if chunk is not None and await anext(events, None) is not None:  # NOTE: its end
                raise RuntimeError("a relay gave more after its answer was read to its end")
        finally:
            await events.aclose()  # NOTE: at once, also when the client left mid-write
