"""API errors: raised anywhere in a handler, turned into OpenAI's error shape once, here."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
    500: "server_error",
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ):
        # NOTE: a message may quote client input; keep it encodable whatever that held.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def sse(self) -> str:
        """The error as a Server-Sent Event, for failures after streaming started."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


async def api_error_handler(_request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def http_error_handler(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method, unreadable body) in OpenAI's shape."""
    return APIError(exc.status_code, str(exc.detail)).response()


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    """Pydantic's 422 becomes OpenAI's 400, naming the first offending parameter. On a
    prefill worker the request's room (if it names one) fails too."""
    response = _validation_response(exc)
    body = exc.body if isinstance(exc.body, dict) else {}
    if "bootstrap_room" in body:
        from pdserve.server.generation import refuse_room

        refuse_room(
            request.app.state.pdserve,
            body["bootstrap_room"],
            "invalid request body",
            body.get("bootstrap_host"),
            body.get("bootstrap_port"),
        )
    return response


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        return bad_request(f"invalid JSON body: {detail}").response()
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "")
    return bad_request(message or "invalid request", param=param).response()
