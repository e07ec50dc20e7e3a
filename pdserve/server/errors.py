"""API errors: raised anywhere in a handler, turned into OpenAI's error shape once, here."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from pdserve.edge.api_errors import error_body
from pdserve.protocol.failures import Failure


class APIError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ):
        # NOTE: a message may quote client input and travel on (a room's failure reason):
        # keep it encodable whatever that held.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def sse(self) -> str:
        """The error as a Server-Sent Event, for failures after streaming started."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def failure_error(failure: Failure) -> APIError:
    """A request's typed failure: the status its kind has in the outcome table, the kind as
    the `code` (a router reads it to decide on a retry)."""
    return APIError(failure.status, failure.message, code=failure.kind.value)


async def api_error_handler(_request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


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
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        return bad_request(f"invalid JSON body: {detail}").response()
    location, tag = _field_location(first.get("loc", ()))
    param = ".".join(location) or None
    if tag is not None:
        # NOTE: a field of several types (a union): pydantic reports one error per type it
        # tried, under the type's name; say which types the field takes instead.
        tags = []
        for error in errors:
            where, other = _field_location(error.get("loc", ()))
            if where == location and other is not None and other not in tags:
                tags.append(other)
        message = f"expected one of: {', '.join(tags)}"
        if "input" in first and len(first.get("loc", ())) == len(location) + 2:
            message += f"; got {_json_kind(first['input'])}"
    elif first.get("type") == "float_type" and type(first.get("input")) is int:
        # NOTE: an integer is a number; pydantic refuses one only past float range, and
        # SamplingParams says so in these words on /generate.
        message = "must be a finite number, got an integer beyond 64 bits"
    else:
        message = first.get("msg", "invalid value")
        if first.get("type", "").endswith("_type") and "input" in first:
            # NOTE: types are strict (no "4" or true for 4): say what came instead.
            message += f", got {_json_kind(first['input'])}"
    message = f"{param}: {message}" if param else message
    return bad_request(message or "invalid request", param=param).response()


def _field_location(loc) -> tuple[list[str], str | None]:
    """The field path of an error location (without "body"), cut at the first union member's
    type name (e.g. `prompt`, `list[int]` for loc body.prompt.list[int].0), and that name."""
    location = []
    for part in loc:
        if part == "body":
            continue
        part = str(part)
        if "[" in part or part in ("str", "int", "float", "bool") or part[:1].isupper():
            return location, part
        location.append(part)
    return location, None


_JSON_KINDS = [
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a float"),
    (str, "a string"),
    (list, "an array"),
    (dict, "an object"),
    (type(None), "null"),
]


def _json_kind(value) -> str:
    return next((kind for python, kind in _JSON_KINDS if isinstance(value, python)), "a value")
