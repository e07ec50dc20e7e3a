"""The API key both HTTP apps (worker and router) require: `Authorization: Bearer KEY` on every
path but their open ones. Torch-free and framework-free: plain ASGI.

Plain ASGI rather than an `http` middleware function: such a function (starlette's
BaseHTTPMiddleware) passes every chunk of a streamed response through memory streams and tasks
of its own. A worker streaming 6,000 tokens a second spent a fifth of its front end's CPU
there (benchmarks/RESULTS.md, prefix caching), and handlers lost the client's own receive
channel (the body as it streams in, the disconnect the moment it happens).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from pdserve.edge.api_errors import error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ApiKeyMiddleware:
    """Refuses with 401, in OpenAI's error shape, an HTTP request to a path outside
    `open_paths` that lacks `Authorization: Bearer <api_key>`; no key: everything passes."""

    def __init__(self, app: ASGIApp, api_key: str | None, open_paths: Collection[str]):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and self.expected is not None
            and scope["path"] not in self.open_paths
        ):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                await _refuse(send)
                return
        await self.app(scope, receive, send)


async def _refuse(send: Send) -> None:
    body = error_body(401, "invalid or missing API key", code="invalid_api_key")
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": data})
