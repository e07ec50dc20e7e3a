"""The router's access line: exactly one per request to a generation endpoint, written when it
ends, with its status, pair, retries, ttft, output tokens and duration (router/access_log.py).
Fake workers (tests/unit/fake_workers.py); no torch, no engine."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi.testclient import TestClient

from pdserve.edge.api_errors import error_body
from pdserve.router.access_log import AccessLog, last_completion_tokens
from pdserve.router.app import build_router_app
from tests.unit.fake_workers import FakeWorkers, worker_error

ACCESS = "pdserve.router.access"
PAIR = "prefill=http://prefill decode=http://decode"
SECONDS = r"\d+\.\d{3}s"


async def _sse(*events, done: bool = True) -> AsyncIterator[bytes]:
    """A worker's stream, one event per chunk, as the router reads it off the wire."""
    for event in events:
        yield b"data: " + json.dumps(event).encode() + b"\n\n"
    if done:
        yield b"data: [DONE]\n\n"


def _answer(body: dict) -> dict:
    """A decode worker's answer: `completion_tokens` is the prompt's length, so each room's
    count differs."""
    tokens = len(body.get("prompt") or body.get("text") or "")
    if "text" in body:  # SGLang's /generate
        return {"text": "x" * tokens, "meta_info": {"completion_tokens": tokens}}
    choice = {"index": 0, "text": "x" * tokens, "finish_reason": "length"}
    usage = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}
    return {"id": "cmpl-1", "choices": [choice], "usage": usage}


async def _prefill(body: dict) -> httpx.Response:
    if body.get("prompt") == "broken":
        return worker_error(500, "the prefill worker failed", "server_error")
    return httpx.Response(200, json={"ok": True})


async def _decode(body: dict) -> httpx.Response:
    if body.get("prompt") == "broken":
        await asyncio.Event().wait()  # NOTE: only a cancellation ends it (prefill failed)
    answer = _answer(body)
    if not body.get("stream"):
        return httpx.Response(200, json=answer)
    if "text" in body:
        return httpx.Response(200, content=_sse(answer))
    usage = {**answer, "choices": []}
    del answer["usage"]
    if body["prompt"] == "dies":
        error = error_body(503, "the engine failed", code="engine_failed")
        return httpx.Response(200, content=_sse(answer, error))
    events = (answer, usage) if body.get("stream_options") else (answer,)
    return httpx.Response(200, content=_sse(*events, done=body["prompt"] != "cut"))


@pytest.fixture(scope="module")
def router():
    fakes = FakeWorkers(prefill=_prefill, decode=_decode)
    config = fakes.config(api_key="sesame", max_rooms_per_request=8, max_body_bytes=4096)
    headers = {"Authorization": "Bearer sesame"}
    with TestClient(build_router_app(config, fakes.transport), headers=headers) as client:
        yield client


def _line(caplog, send) -> tuple[httpx.Response, str]:
    """The response to `send()` and the one access line it wrote."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=ACCESS):
        response = send()
    lines = [r.getMessage() for r in caplog.records if r.name == ACCESS]
    assert len(lines) == 1, lines
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == ACCESS)
    return response, lines[0]


def _expect(line: str, pattern: str) -> None:
    """`line` is `pattern` (a regular expression) and then the duration."""
    assert re.fullmatch(rf"{pattern} duration={SECONDS}", line), line


def test_a_completion_has_its_pair_and_tokens_and_no_ttft(router, caplog):
    body = {"prompt": "four", "max_tokens": 4}
    headers = {"X-Request-Id": "req-1"}
    response, line = _line(
        caplog, lambda: router.post("/v1/completions", json=body, headers=headers)
    )
    assert response.status_code == 200
    _expect(line, f"request req-1 POST /v1/completions 200 {PAIR} ttft=- tokens=4")


def test_a_request_without_an_id_is_logged_with_the_one_it_was_given(router, caplog):
    response, line = _line(caplog, lambda: router.post("/v1/completions", json={"prompt": "abc"}))
    assert line.startswith(f"request {response.headers['x-request-id']} POST ")


def test_a_stream_has_its_ttft_and_the_tokens_of_its_usage_chunk(router, caplog):
    body = {"prompt": "seven!!", "stream": True, "stream_options": {"include_usage": True}}
    response, line = _line(caplog, lambda: router.post("/v1/completions", json=body))
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    request_id = response.headers["x-request-id"]
    _expect(
        line,
        f"request {request_id} POST /v1/completions 200 {PAIR} ttft={SECONDS} tokens=7",
    )
    ttft, duration = (float(v) for v in re.findall(r"=(\d+\.\d{3})s", line))
    assert ttft <= duration


def test_a_stream_without_usage_has_no_tokens(router, caplog):
    body = {"prompt": "seven!!", "stream": True}
    _, line = _line(caplog, lambda: router.post("/v1/completions", json=body))
    assert " 200 " in line and " tokens=- " in line


def test_generate_counts_sglangs_meta_info(router, caplog):
    for stream in (False, True):
        body = {"text": "five!", "stream": stream}
        _, line = _line(caplog, lambda b=body: router.post("/generate", json=b))
        assert " POST /generate 200 " in line and " tokens=5 " in line, line


def test_a_stream_a_worker_ends_with_an_error_says_so(router, caplog):
    body = {"prompt": "dies", "stream": True}
    response, line = _line(caplog, lambda: router.post("/v1/completions", json=body))
    assert response.status_code == 200 and "the engine failed" in response.text
    _expect(
        line,
        rf"request \S+ POST /v1/completions 200 stream-error=503 {PAIR} ttft={SECONDS} tokens=-",
    )


def test_a_merged_stream_the_router_ends_with_an_error_says_so(router, caplog):
    body = {"prompt": ["cut", "whole"], "stream": True}
    response, line = _line(caplog, lambda: router.post("/v1/completions", json=body))
    assert response.status_code == 200 and "without [DONE]" in response.text
    pattern = rf"request \S+ POST /v1/completions 200 stream-error=502 rooms=2 {PAIR} ttft=\S+"
    _expect(line, pattern + " tokens=-")


@pytest.mark.parametrize(
    "send, status",
    [
        (lambda c: c.post("/v1/completions", content=b"{oops"), 400),
        (lambda c: c.post("/generate", content=b"[1]"), 400),
        (lambda c: c.post("/v1/completions", json={"prompt": list("abcdefghi")}), 400),  # rooms
        (lambda c: c.post("/v1/completions", json={}, headers={"Authorization": "Bearer no"}), 401),
        (lambda c: c.post("/v1/completions", content=b"{" + b" " * 5000 + b"}"), 413),
    ],
)
def test_a_request_refused_before_pairing_has_no_workers(router, caplog, send, status):
    response, line = _line(caplog, lambda: send(router))
    assert response.status_code == status
    workers = "prefill=- decode=- ttft=- tokens=-"
    _expect(line, rf"request \S+ POST \S+ {status} {workers}")


def test_a_failed_leg_has_its_status_pair_and_retry(router, caplog):
    body = {"prompt": "broken"}
    response, line = _line(caplog, lambda: router.post("/v1/completions", json=body))
    assert response.status_code == 500
    _expect(line, rf"request \S+ POST /v1/completions 500 {PAIR} retries=1 ttft=- tokens=-")


@pytest.mark.parametrize("stream", [False, True])
def test_several_rooms_are_counted_with_their_pair_and_summed_tokens(router, caplog, stream):
    body = {"prompt": ["a", "bb", "ccc"], "n": 2, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response, line = _line(caplog, lambda: router.post("/v1/completions", json=body))
    assert response.status_code == 200
    ttft = SECONDS if stream else "-"
    _expect(
        line,
        rf"request \S+ POST /v1/completions 200 rooms=6 {PAIR} ttft={ttft} tokens=12",
    )


# ---- what the middleware sees ---------------------------------------------------------


def _serve(app, path: str = "/generate") -> None:
    """One request, X-Request-Id `r`, through AccessLog to `app` (plain ASGI)."""
    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"x-request-id", b"r")]}

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    asyncio.run(AccessLog(app, {path})(scope, receive, send))


def test_a_client_that_left_mid_stream_is_logged_as_disconnected(caplog):
    async def cut_off(scope, receive, send):
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        # NOTE: the stream ends here, as StreamingResponse's does when the client leaves

    _, line = _line(caplog, lambda: _serve(cut_off))
    workers = "prefill=- decode=-"
    _expect(
        line, rf"request r POST /generate 200 client-disconnected {workers} ttft={SECONDS} tokens=-"
    )


def test_a_client_that_left_before_any_byte_is_logged_as_disconnected(caplog):
    async def gave_up(scope, receive, send):  # NOTE: what the proxy answers then (499)
        await send({"type": "http.response.start", "status": 499, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    _, line = _line(caplog, lambda: _serve(gave_up))
    workers = "prefill=- decode=-"
    _expect(line, rf"request r POST /generate 499 client-disconnected {workers} ttft=- tokens=-")


def test_a_bug_is_logged_as_an_internal_error(caplog):
    async def broken(scope, receive, send):
        raise RuntimeError("a bug")

    def serve():
        with pytest.raises(RuntimeError, match="a bug"):
            _serve(broken)

    _, line = _line(caplog, serve)
    assert line.startswith("request r POST /generate 500 internal-error prefill=- "), line


def test_only_the_key_itself_counts_as_completion_tokens():
    assert last_completion_tokens(b'{"usage": {"completion_tokens": 12}}') == 12
    assert last_completion_tokens(b'{"completion_tokens":3}, {"completion_tokens": 4}') == 4
    text = json.dumps({"text": '"completion_tokens": 9', "completion_tokens_details": 1})
    assert last_completion_tokens(text.encode()) is None
