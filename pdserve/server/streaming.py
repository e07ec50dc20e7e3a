"""Answers that notice a client that left even while they have nothing to send (see
protocol.asgi_watch): ending the request at once aborts its engine requests and frees their KV
pages, instead of keeping them until the transfer deadline. A streamed answer closes its
stream; a whole (non-streamed) answer cancels the work that collects it.

A client that leaves is a normal end of a request, not a server error: one INFO line, an
answer nobody reads (499), and the engine requests counted as the aborts they were (or as
what they finished with, if they finished first)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.edge.asgi_watch import until_done_or_client_left

logger = logging.getLogger(__name__)

T = TypeVar("T")
DISCONNECT_POLL_S = 0.1
CLIENT_LEFT = 499  # NOTE: nginx's status for a client that closed its connection


class WatchfulStreamingResponse(StreamingResponse):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await until_done_or_client_left(super().__call__(scope, receive, send), receive)


async def whole_unless_client_left(request: Request, work: Awaitable[T]) -> T | Response:
    """`work`'s result (a whole answer's content), or, when the client leaves first, the 499
    that ends the request: `work` is then cancelled, which aborts its engine requests."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.wait({task})  # NOTE: its cleanup (the aborts) runs to its end
            if not task.cancelled():
                task.exception()  # NOTE: retrieved: whatever it ended with, nobody reads it
            logger.info("%s %s: the client left before its answer", request.method,
                        request.url.path)  # fmt: skip
            return Response(status_code=CLIENT_LEFT)
    return task.result()
