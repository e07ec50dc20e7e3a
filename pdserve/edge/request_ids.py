"""Request ids: one per client request, end to end. Torch-free.

A request's id is the client's `X-Request-Id`, else one the first pdserve process it reaches
makes (the router; a worker when called directly). The router sends it on both legs, each
worker sends it back in its answer's `X-Request-Id` and builds its engine request ids from it
(`server/access_log.py`), so every process's log lines about the request name it.
"""

from __future__ import annotations

import secrets

HEADER = b"x-request-id"
# A request id travels in every message about its request, and in every log line.
MAX_REQUEST_ID_CHARS = 256


class RequestIdError(ValueError):
    """An `X-Request-Id` that cannot name a request."""


def new_request_id() -> str:
    """32 random hex digits (a uuid4's length; without its version bits, cheaper to make)."""
    return secrets.token_hex(16)


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The request's id: its `X-Request-Id` (ASGI headers: lower-case names), else a new one.
    Raises `RequestIdError` for one that cannot go into log lines and messages as is: empty,
    longer than `MAX_REQUEST_ID_CHARS`, or holding anything but visible ASCII."""
    given = next((value for key, value in headers if key == HEADER), None)
    if given is None:
        return new_request_id()
    if not 0 < len(given) <= MAX_REQUEST_ID_CHARS or not all(0x21 <= b <= 0x7E for b in given):
        raise RequestIdError(
            f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII characters "
            f"(no spaces), got {len(given)} bytes"
        )
    return given.decode("ascii")
