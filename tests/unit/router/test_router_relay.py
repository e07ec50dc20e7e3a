"""The router's hot path from the body's end to the stream's: a client that leaves mid-stream
(router/intake.py's ClientWatch), deadlines, and a stream whose worker answered whole going
out with its end in one write (router/relay.py's EventStream). Fake workers
(tests/unit/fake_workers.py) or scripted ones; no torch, no engine."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi.testclient import TestClient

from pdserve.router.app import build_router_app
from pdserve.router.intake import ClientWatch
from pdserve.router.relay import EventStream
from tests.unit.fake_workers import FakeWorkers

EVENT = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
BODY = {"prompt": "hi", "max_tokens": 8, "stream": True}


def _hanging_stream(closed: asyncio.Event):
    """A decode leg that streams one event and then nothing (a worker waiting for its next
    token); `closed` is set once the router closed the stream (which aborts it there)."""

    async def events() -> AsyncIterator[bytes]:
        try:
            yield EVENT
            await asyncio.Event().wait()
        finally:
            closed.set()

    async def decode(body: dict) -> httpx.Response:
        return httpx.Response(200, content=events())

    return decode


async def _post(app, body: dict, leave_after_first_byte: bool) -> list[dict]:
    """POST /v1/completions through `app` as a server would run it (its lifespan around):
    the messages it sent. The client leaves once a body byte came, if asked to; else, as
    servers do, the response's end is reported as a disconnect."""
    data = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
    }
    messages, gone, read = [], asyncio.Event(), False

    async def receive():
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": data, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        messages.append(message)
        ended = message["type"] == "http.response.body" and not message.get("more_body")
        if ended or (leave_after_first_byte and message.get("body")):
            gone.set()

    async with app.router.lifespan_context(app):
        await _ends(app(scope, receive, send))
        return messages


async def _ends(request):
    """`request`'s result; it must end by itself (no cancellation on a timeout, which the
    router would take for the client leaving)."""
    task = asyncio.ensure_future(request)
    done, _ = await asyncio.wait({task}, timeout=10)
    assert done, "the request did not end within 10 s"
    return task.result()


def test_a_client_that_leaves_mid_stream_ends_the_stream_and_its_decode_leg(caplog):
    async def run():
        closed = asyncio.Event()
        fakes = FakeWorkers(decode=_hanging_stream(closed))
        app = build_router_app(fakes.config(), fakes.transport)
        with caplog.at_level(logging.INFO, logger="pdserve.router.access"):
            messages = await _post(app, BODY, leave_after_first_byte=True)
        await asyncio.wait_for(closed.wait(), 10)
        return messages

    messages = asyncio.run(run())
    assert [m["type"] for m in messages] == ["http.response.start", "http.response.body"]
    assert messages[1]["body"] == EVENT and messages[1]["more_body"]
    lines = [r.getMessage() for r in caplog.records if r.name == "pdserve.router.access"]
    assert len(lines) == 1 and " 200 client-disconnected " in lines[0], lines


def test_a_stream_that_stalls_past_the_deadline_ends_with_a_504_event():
    closed = asyncio.Event()
    fakes = FakeWorkers(decode=_hanging_stream(closed))
    app = build_router_app(fakes.config(request_timeout_s=0.3), fakes.transport)
    with TestClient(app) as client, client.stream("POST", "/v1/completions", json=BODY) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200
    assert lines[0] == EVENT.decode().strip()
    error = json.loads(lines[1].removeprefix("data: "))["error"]
    assert "timed out while streaming" in error["message"] and error["code"] == "timeout"
    assert lines[2:] == ["data: [DONE]"]


def test_a_decode_worker_silent_past_the_deadline_is_a_504():
    async def decode(body: dict) -> httpx.Response:
        await asyncio.Event().wait()  # NOTE: only a cancellation ends it

    fakes = FakeWorkers(decode=decode)
    app = build_router_app(fakes.config(request_timeout_s=0.3), fakes.transport)
    with TestClient(app) as client:
        response = client.post("/v1/completions", json=BODY)
    assert response.status_code == 504
    assert response.json()["error"]["message"].endswith("request timed out")
    assert fakes.cancelled == ["decode"]


# ---- the stream's end ------------------------------------------------------------------


async def _relay(chunks: list[bytes], finished_after: int | None) -> tuple[list[dict], list]:
    """An EventStream of `chunks` whose worker's answer was read whole once `finished_after`
    of them were taken (None: never known): the messages it sent, and when its events
    ended (the number of messages sent by then)."""
    messages, ended, taken = [], [], 0

    async def events() -> AsyncIterator[bytes]:
        nonlocal taken
        for chunk in chunks:
            taken += 1
            yield chunk
        ended.append(len(messages))

    async def never() -> dict:
        await asyncio.Event().wait()

    async def send(message):
        messages.append(message)

    watch = ClientWatch(never)
    finished = (lambda: False) if finished_after is None else (lambda: taken >= finished_after)
    await EventStream(events(), {"X-Request-Id": "r"}, watch, finished)(None, never, send)
    watch.stop()
    return messages, ended


def _bodies(messages: list[dict]) -> list[tuple[bytes, bool]]:
    assert messages[0] == {
        "type": "http.response.start",
        "status": 200,
        "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"x-request-id", b"r"),
        ],
    }
    return [(m["body"], m["more_body"]) for m in messages[1:]]


def test_a_stream_read_whole_ends_in_the_write_of_its_last_chunk():
    messages, ended = asyncio.run(_relay([b"a", b"b"], finished_after=2))
    assert _bodies(messages) == [(b"a", True), (b"b", False)]
    assert ended == [3]  # NOTE: the relay still ends (its rooms closed), after the last write


def test_a_relay_that_gives_more_after_its_answer_was_read_whole_is_a_bug():
    with pytest.raises(RuntimeError, match="gave more"):
        asyncio.run(_relay([b"a", b"b"], finished_after=1))


def test_a_stream_whose_end_is_not_known_gets_an_end_of_its_own():
    messages, ended = asyncio.run(_relay([b"a", b"b"], finished_after=None))
    assert _bodies(messages) == [(b"a", True), (b"b", True), (b"", False)]
    assert ended == [3]


def test_an_empty_stream_still_starts_and_ends():
    messages, _ = asyncio.run(_relay([], finished_after=None))
    assert _bodies(messages) == [(b"", False)]


# ---- the watch -------------------------------------------------------------------------


@pytest.mark.parametrize("left", [True, False])
def test_the_watch_tells_its_own_cancellation_from_anyone_elses(left):
    async def run():
        gone = asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def request():
            watch = ClientWatch(receive)
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                caught = watch.caught()
                return caught, asyncio.current_task().cancelling()
            finally:
                watch.stop()

        task = asyncio.create_task(request())
        await asyncio.sleep(0)  # NOTE: the request starts its watch
        gone.set() if left else task.cancel()
        return await _ends(task)

    caught, cancelling = asyncio.run(run())
    assert caught is left
    assert cancelling == (0 if left else 1)  # NOTE: only the watch's own request is withdrawn


def test_a_stopped_watch_cancels_nothing():
    async def run():
        async def receive():
            return {"type": "http.disconnect"}  # NOTE: a finished response, as servers say

        watch = ClientWatch(receive)
        watch.stop()
        for _ in range(5):  # NOTE: the listener's turns: a cancellation would land here
            await asyncio.sleep(0)
        return watch.left

    assert asyncio.run(run()) is False
