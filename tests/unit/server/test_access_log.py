"""Request ids at a worker's HTTP edge (`edge/request_ids.py`, `server/access_log.py`): the
client's `X-Request-Id` or a new one, sent back on every answer and written in the access line;
one that cannot name a request refused with 400 before the app runs."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest

from pdserve.edge.request_ids import (
    MAX_REQUEST_ID_CHARS,
    RequestIdError,
    request_id_of,
)
from pdserve.server.access_log import RequestIdMiddleware, scope_request_id


def test_the_clients_id_is_kept_as_given():
    assert request_id_of([(b"x-request-id", b"abc-123_X.y")]) == "abc-123_X.y"
    longest = b"i" * MAX_REQUEST_ID_CHARS
    assert request_id_of([(b"x-request-id", longest)]) == longest.decode()


def test_without_a_header_each_request_gets_a_new_id():
    first, second = request_id_of([]), request_id_of([(b"accept", b"*/*")])
    assert re.fullmatch(r"[0-9a-f]{32}", first) and re.fullmatch(r"[0-9a-f]{32}", second)
    assert first != second


@pytest.mark.parametrize(
    "given",
    [b"", b"has space", b"tab\there", b"i" * (MAX_REQUEST_ID_CHARS + 1), "café".encode()],
    ids=["empty", "space", "tab", "too-long", "utf8"],
)
def test_an_id_that_cannot_go_into_a_log_line_is_refused_naming_the_header(given):
    with pytest.raises(RequestIdError, match=r"X-Request-Id must be 1 to 256 visible ASCII"):
        request_id_of([(b"x-request-id", given)])


def _call(headers: list[tuple[bytes, bytes]], path: str = "/v1/completions", method="POST"):
    """The middleware around an app that answers 201 and notes the id it saw."""
    seen: dict[str, str] = {}
    sent: list[dict] = []

    async def app(scope, receive, send):
        seen["id"] = scope_request_id(scope)
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": headers,
        "client": ("10.1.2.3", 4567),
    }
    asyncio.run(RequestIdMiddleware(app)(scope, receive, send))
    return seen.get("id"), sent


def test_the_answer_carries_the_id_the_app_saw(caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.server.access"):
        seen, sent = _call([(b"x-request-id", b"client-7")])
    assert seen == "client-7"
    assert (b"x-request-id", b"client-7") in sent[0]["headers"]
    [line] = [r.getMessage() for r in caplog.records if r.name == "pdserve.server.access"]
    assert line.startswith("request client-7 POST /v1/completions 201 client=10.1.2.3:4567 ")
    assert re.search(r" duration=\d+\.\d{3}s$", line)


def test_a_made_id_is_the_one_sent_back(caplog):
    seen, sent = _call([])
    assert seen is not None and (b"x-request-id", seen.encode()) in sent[0]["headers"]


def test_probes_log_only_at_debug(caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.server.access"):
        _call([], path="/health", method="GET")
    assert not [r for r in caplog.records if r.name == "pdserve.server.access"]
    with caplog.at_level(logging.DEBUG, logger="pdserve.server.access"):
        _call([], path="/health", method="GET")
    assert [r.levelno for r in caplog.records if r.name == "pdserve.server.access"] == [10]


def test_a_bad_id_is_refused_before_the_app_runs(caplog):
    seen, sent = _call([(b"x-request-id", b"two words")])
    assert seen is None
    assert sent[0]["status"] == 400
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "invalid_request_id" and "X-Request-Id" in error["message"]
