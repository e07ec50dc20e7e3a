"""A streaming response that notices a client that left even while it has nothing to send.

Under servers that speak ASGI 2.4 (uvicorn), Starlette's StreamingResponse learns that its
client left only when a write fails. A stream with nothing to write yet, such as a decode
leg waiting for its KV (which never comes when the router dropped the request before its
prefill leg went out), would keep the request, and its reserved KV pages, until the transfer
deadline. This one also listens for the disconnect and closes the stream at once, which
aborts the engine request and frees its pages.
"""

from __future__ import annotations

import asyncio

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class WatchfulStreamingResponse(StreamingResponse):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(super().__call__(scope, receive, send))
        left = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({stream, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, left):
                task.cancel()
            await asyncio.gather(stream, left, return_exceptions=True)
        if not stream.cancelled() and stream.exception() is not None:
            raise stream.exception()


async def _until_disconnect(receive: Receive) -> None:
    """Returns when the client closes its connection (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass
