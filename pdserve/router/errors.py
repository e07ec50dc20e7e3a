"""Errors the router returns, in OpenAI's shape (the workers use the same). Torch-free."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None):
    kind = _TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, code: str | None = None, headers=None, param: str | None = None
):
    body = error_body(status, message, code, param)
    return JSONResponse(body, status_code=status, headers=headers)


def error_event(status: int, message: str, code: str | None = None) -> bytes:
    """An error as a Server-Sent Event, for failures after a stream started."""
    return f"data: {json.dumps(error_body(status, message, code))}\n\n".encode()


class LegError(Exception):
    """A prefill or decode leg failed. `retryable`: a new pair may succeed (the worker or the
    transfer failed, not the request)."""

    def __init__(self, role: str, status: int, body: dict | None, message: str, retryable: bool):
        super().__init__(f"{role} leg: {message}")
        self.role = role
        self.status = status
        self.body = body or error_body(status, f"{role} worker: {message}")
        self.retryable = retryable

    def response(self, headers=None) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=headers)

    def event(self) -> bytes:
        return f"data: {json.dumps(self.body)}\n\n".encode()
