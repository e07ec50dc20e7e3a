"""What the router makes of its workers' errors: the outcome an error names (status, retry), the
error a failed leg raises, the SSE error event a broken stream ends with. Torch-free. The
responses themselves are OpenAI's shape, built by `edge` as the workers build theirs."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from pdserve.edge.api_errors import error_body
from pdserve.protocol.failures import Outcome, outcome_of_code

# The status a worker's error event stands for, by its type (streams carry no status).
_EVENT_STATUS = {"invalid_request_error": 400, "rate_limit_error": 429}


def worker_outcome(error: object, status: int | None = None) -> Outcome:
    """What a worker's error (the `error` object of its answer, or of an SSE event, which has
    no status) means here: the outcome table's status and retry for its `code` when that is a
    FailureKind (protocol/failures.py). Any other error keeps its status (an event's: 400 or
    429 by its type, else 503) and is retried when that is a 5xx: the worker failed, not the
    request."""
    error = error if isinstance(error, dict) else {}
    outcome = outcome_of_code(error.get("code"))
    if outcome is not None:
        return outcome
    if status is None:
        status = _EVENT_STATUS.get(error.get("type"), 503)
    return Outcome(status, status >= 500)


def error_event(status: int, message: str, code: str | None = None) -> bytes:
    """An error as a Server-Sent Event, for failures after a stream started."""
    return f"data: {json.dumps(error_body(status, message, code=code))}\n\n".encode()


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


def leg_error(role: str, status: int, content: bytes) -> LegError:
    """A leg's answer with a status other than 200, as a LegError."""
    try:
        body = json.loads(content)
        error = body["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        body, error = None, None
        message = content[:200].decode(errors="replace") or f"HTTP {status}"
    outcome = worker_outcome(error, status)
    return LegError(role, outcome.status, body, message, outcome.retryable)


def raise_if_error_event(role: str, head: bytes) -> None:
    """A stream whose first event is an error failed before sending anything."""
    first = head.split(b"\n\n", 1)[0].strip()  # NOTE: an SSE event ends with a blank line
    # NOTE: no JSON parsing of every stream's first event: an error event's key is written
    # as it is (json.dumps escapes no ASCII letter).
    if not first.startswith(b"data:") or b'"error"' not in first:
        return
    try:
        event = json.loads(first[5:])
    except ValueError:
        return
    if isinstance(event, dict) and isinstance(event.get("error"), dict):
        error = event["error"]
        outcome = worker_outcome(error)
        raise LegError(role, outcome.status, event, str(error.get("message")), outcome.retryable)
