"""The error handlers both HTTP apps (router and workers) install, written once: the
framework's own errors (unknown path, wrong method, a body too large) and bugs, in OpenAI's
shape (`api_errors`). Torch-free."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from pdserve.edge.api_errors import error_body, framework_error_body, internal_error_body


def error_response(
    status: int, message: str, code: str | None = None, headers=None, param: str | None = None
) -> JSONResponse:
    return JSONResponse(
        error_body(status, message, param, code), status_code=status, headers=headers
    )


async def http_error_handler(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors in OpenAI's shape, with their headers (a 405's Allow)."""
    headers = dict(exc.headers or {})
    body = framework_error_body(
        exc.status_code, str(exc.detail), request.method, request.url.path, headers.get("Allow")
    )
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def internal_error_handler(who: str) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
    """The handler for a bug in `who` ("router", "worker"): 500 in OpenAI's shape; the
    traceback goes to the log, never to the client."""

    async def handle(_request: Request, _exc: Exception) -> JSONResponse:
        return JSONResponse(internal_error_body(who), status_code=500)

    return handle
