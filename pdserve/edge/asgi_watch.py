"""Streams that notice a client that left even while they have nothing to send. Torch-free.

Under servers that speak ASGI 2.4 (uvicorn), a streaming response learns that its client left
only when a write fails. A stream with nothing to write yet (a decode leg waiting for its KV,
a router waiting for a worker's first token) would keep the request, and what it holds, until
its deadline. Running the stream beside a listener for the disconnect ends it at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

Receive = Callable[[], Awaitable[dict[str, Any]]]


async def client_left(receive: Receive) -> None:
    """Returns when the client closes its connection. Only after the body was read: every
    message left on the channel then is the disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_done_or_client_left(stream: Awaitable[None], receive: Receive) -> None:
    """Run `stream` (a response's writes) until it ends or its client leaves, whichever comes
    first; the other is cancelled. What the stream raised is raised again."""
    writing = asyncio.ensure_future(stream)
    left = asyncio.ensure_future(client_left(receive))
    try:
        await asyncio.wait({writing, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (writing, left):
            task.cancel()
        await asyncio.gather(writing, left, return_exceptions=True)
    if not writing.cancelled() and writing.exception() is not None:
        raise writing.exception()
