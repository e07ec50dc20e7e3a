"""A streaming response that notices a client that left even while it has nothing to send
(see protocol.asgi_watch): closing the stream at once aborts the engine request and frees its
KV pages, instead of keeping them until the transfer deadline."""

from __future__ import annotations

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.protocol.asgi_watch import until_done_or_client_left


class WatchfulStreamingResponse(StreamingResponse):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await until_done_or_client_left(super().__call__(scope, receive, send), receive)
