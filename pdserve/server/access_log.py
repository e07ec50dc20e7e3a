"""A worker's request id, and its access line: one id per request from the client to the engine.

The id is the client's `X-Request-Id` (through the router: the client's, else the one the
router made, the same on both legs), else one made here. Every response carries it back in
`X-Request-Id`; the engine request ids of the request are built from it (`cmpl-ID`, `cmpl-ID-2`
for a fan-out), so the router's access line, this worker's and its engine process's log lines
all name it: one grep finds a request's whole life.

Each request ends with one line on `pdserve.server.access`, at INFO (probes and scrapes, every
few seconds each, at DEBUG); it replaces uvicorn's, which names no request:

    request 3f2a... POST /v1/completions 200 client=127.0.0.1:50514 duration=0.180s

A header that cannot serve as an id (`edge/request_ids.py`: empty, too long, or holding
anything but visible ASCII) is refused with 400 naming it, before the request runs.

Plain ASGI, like `ApiKeyMiddleware` (its docstring says why).
"""

from __future__ import annotations

import logging
import time

from pdserve.edge.access_lines import write_line
from pdserve.edge.api_key import ASGIApp, Receive, Scope, Send
from pdserve.edge.error_handlers import error_response
from pdserve.edge.request_ids import (
    HEADER,
    RequestIdError,
    new_request_id,
    request_id_of,
)

logger = logging.getLogger("pdserve.server.access")

# Paths a load balancer or Prometheus polls: their access lines only at DEBUG.
PROBE_PATHS = frozenset({"/health", "/health_generate", "/liveness", "/metrics"})


def scope_request_id(scope: Scope) -> str:
    """The id `RequestIdMiddleware` gave this request (a new one outside it: tests)."""
    return scope.get("state", {}).get("request_id") or new_request_id()


class RequestIdMiddleware:
    """Gives each HTTP request its id (`scope["state"]["request_id"]`, which starlette's
    `request.state.request_id` reads), sends it back in `X-Request-Id`, and logs its access
    line when it ends."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        try:
            request_id = request_id_of(scope["headers"])
        except RequestIdError as e:
            await error_response(400, str(e), "invalid_request_id")(scope, receive, send)
            return
        scope.setdefault("state", {})["request_id"] = request_id
        status = 0  # until the response starts; 0 in the line: the client left before it

        async def send_with_id(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [h for h in message.get("headers", []) if h[0].lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            level = logging.DEBUG if scope["path"] in PROBE_PATHS else logging.INFO
            if logger.isEnabledFor(level):
                line = _line(scope, request_id, status, time.monotonic() - started)
                write_line(logger, level, line)


def _line(scope: Scope, request_id: str, status: int, seconds: float) -> str:
    client = scope.get("client")
    peer = f"{client[0]}:{client[1]}" if client else "-"
    return (
        f"request {request_id} {scope['method']} {scope['path']} {status} "
        f"client={peer} duration={seconds:.3f}s"
    )
