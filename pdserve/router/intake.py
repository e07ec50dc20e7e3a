"""What the router takes from a client before any worker is involved (past the API key,
edge/api_key.py): a body of bounded size that is a JSON object, and the moment the client
leaves. Torch-free.

The body is read as it arrives and refused with 413 as soon as it passes the limit (at once
when its Content-Length says it will), so an oversized upload costs the router no more memory
than the limit; the 413 closes the connection, so the rest of the upload is never read.

A client that leaves ends its request wherever the request is (`ClientWatch`): waiting for a
worker's first answer, or in the middle of a stream waiting for the next token. One listener
per request, for its whole life, and the request's work in the request's own task: the
router's CPU per request is what bounds it under load (benchmarks/RESULTS.md, router
overhead), and a listener per phase, each beside a task for the work, cost three tasks more.
"""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect
from starlette.types import Receive

from pdserve.edge.asgi_watch import client_left
from pdserve.edge.error_handlers import error_response
from pdserve.edge.strict_json import BodyTooLarge, InvalidJSON, parse_json, read_bounded


class BadBody(Exception):
    """The request body cannot be forwarded: too large (413) or not a JSON object (400)."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code

    def response(self):
        # NOTE: closing the connection is what stops the client's upload: an unread body
        # cannot be skipped on a kept-alive HTTP/1.1 connection.
        headers = {"Connection": "close"} if self.status == 413 else None
        return error_response(self.status, str(self), self.code, headers)


async def read_json_body(receive: Receive, declared_length: str | None, limit: int) -> dict:
    """The body as a JSON object, read chunk by chunk and never held past `limit` bytes, and
    parsed strictly (no NaN, lone surrogates or deep nesting). `declared_length`: the
    request's Content-Length header, if any. Raises BadBody, or starlette's ClientDisconnect
    if the client leaves mid-upload."""
    try:
        raw = await read_bounded(_BodyChunks(receive), declared_length, limit)
        body = parse_json(raw)
    except BodyTooLarge:
        raise BadBody(
            413, f"request body over {limit} bytes (the router's --max-body-size)", "body_too_large"
        ) from None
    except InvalidJSON as e:
        raise BadBody(400, f"invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise BadBody(400, "the request body must be a JSON object")
    return body


class _BodyChunks:
    """The request body's chunks as they arrive (what starlette's `Request.stream` gives,
    without a Request per request). A class: an async generator costs the event loop's
    bookkeeping, per request."""

    def __init__(self, receive: Receive):
        self.receive = receive
        self.more = True

    def __aiter__(self) -> _BodyChunks:
        return self

    async def __anext__(self) -> bytes:
        if not self.more:
            raise StopAsyncIteration
        message = await self.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        self.more = message.get("more_body", False)
        return message.get("body", b"")


class ClientWatch:
    """Cancels the task that serves a request the moment its client leaves. Start it once the
    body was read (every message left on the channel is then the disconnect) and `stop` it
    when the answer is out; in between, a CancelledError may be the watch's (`caught`).

    NOTE: servers also report a finished response as a disconnect: the watch must be stopped
    before the answer's last message is sent (EventStream does), or with nothing awaited
    between that send and `stop` (a whole answer's send is the handler's last await)."""

    def __init__(self, receive: Receive):
        self.left = False
        self._task: asyncio.Task | None = asyncio.current_task()
        self._withdrawn = False
        self._listener = asyncio.ensure_future(client_left(receive))
        self._listener.add_done_callback(self._heard)

    def stop(self) -> None:
        self._task = None
        self._listener.cancel()

    def caught(self) -> bool:
        """In `except CancelledError`: whether the cancellation is the watch's (the client
        left) and no one else's; the watch's cancel request is then withdrawn, so the task
        goes on (to its cleanup and its access line) as if it had not been cancelled."""
        if not self.left:
            return False
        task = asyncio.current_task()
        if not self._withdrawn:
            self._withdrawn = True
            return task.uncancel() == 0
        return task.cancelling() == 0

    def _heard(self, listener: asyncio.Future) -> None:
        if listener.cancelled() or listener.exception() is not None:
            return  # NOTE: stopped, or a receive that failed: nothing to go by
        if self._task is not None and not self._task.done():
            self.left = True
            self._task.cancel()
