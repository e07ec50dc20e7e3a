"""What the router takes from a client before any worker is involved (past the API key,
protocol/api_key.py): a body of bounded size that is a JSON object, and the moment the client
leaves. Torch-free.

The body is read as it arrives and refused with 413 as soon as it passes the limit (at once
when its Content-Length says it will), so an oversized upload costs the router no more memory
than the limit; the 413 closes the connection, so the rest of the upload is never read.
"""

from __future__ import annotations

from starlette.requests import Request

from pdserve.protocol.strict_json import BodyTooLarge, InvalidJSON, parse_json, read_bounded
from pdserve.router.errors import error_response


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


async def read_json_body(request: Request, limit: int) -> dict:
    """The body as a JSON object, read chunk by chunk and never held past `limit` bytes, and
    parsed strictly (no NaN, lone surrogates or deep nesting). Raises BadBody, or
    starlette's ClientDisconnect if the client leaves mid-upload."""
    try:
        raw = await read_bounded(request.stream(), request.headers.get("content-length"), limit)
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
