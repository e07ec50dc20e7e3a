"""At its shutdown timeout the router ends what it still runs well-formed (router/shutdown.py):
a stream being relayed with an SSE error event and `[DONE]`, a request still waiting for its
workers with a 503; either way its legs are closed (aborted on the workers). Fake workers;
`end_requests` is what the HTTP server calls at the timeout (commands/http_shutdown.py)."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from pdserve.router.app import build_router_app
from tests.unit.fake_workers import FakeWorkers, completion
from tests.waiting import wait_until

BODY = {"prompt": "hi", "max_tokens": 2}
# NOTE: a router that does not end its requests answers 504 at this deadline instead.
CONFIG = {"request_timeout_s": 20.0}
REASON = "the server is shutting down"


def _end_when(reached: threading.Event, client: TestClient) -> threading.Thread:
    """End the router's requests (in its loop) once `reached` is set."""

    def end() -> None:
        assert reached.wait(30), "the request never reached the point to end it at"
        client.portal.call(client.app.state.end_requests, REASON)

    thread = threading.Thread(target=end, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_still_waiting_for_its_workers_gets_a_503(stream):
    reached = threading.Event()

    async def hang(body):
        reached.set()
        await asyncio.Event().wait()  # NOTE: only a cancellation ends it

    fakes = FakeWorkers(prefill=hang, decode=hang)
    with TestClient(build_router_app(fakes.config(**CONFIG), fakes.transport)) as client:
        ending = _end_when(reached, client)
        response = client.post("/v1/completions", json={**BODY, "stream": stream})
        ending.join(30)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert (error["message"], error["code"]) == (REASON, "unavailable")
        wait_until(lambda: sorted(fakes.cancelled) == ["decode", "prefill"], "legs cancelled")


def test_a_stream_being_relayed_ends_with_an_error_event_and_done():
    streaming = threading.Event()
    closed = threading.Event()
    first = b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n'

    async def decode(body):
        async def events():
            try:
                yield first
                streaming.set()
                await asyncio.Event().wait()  # NOTE: a long generation
                yield b"data: [DONE]\n\n"
            finally:
                closed.set()

        return httpx.Response(200, content=events())

    async def prefill(body):
        return completion()

    fakes = FakeWorkers(prefill=prefill, decode=decode)
    with TestClient(build_router_app(fakes.config(**CONFIG), fakes.transport)) as client:
        ending = _end_when(streaming, client)
        response = client.post("/v1/completions", json={**BODY, "stream": True})
        ending.join(30)
    assert response.status_code == 200
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[0].encode() == first.removeprefix(b"data: ").removesuffix(b"\n\n")
    assert json.loads(events[1])["error"]["code"] == "unavailable", events
    assert json.loads(events[1])["error"]["message"] == REASON
    assert events[2:] == ["[DONE]"], events
    assert closed.wait(10), "the decode leg was never closed"
