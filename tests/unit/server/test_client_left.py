"""A client that leaves a non-streamed request before its answer, on a worker: a normal end
(one INFO line, the engine request aborted and counted as an abort), not the ERROR traceback
of a CancelledError escaping the app."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest

from pdserve.engine.core.config import EngineConfig
from pdserve.server.app import build_app
from pdserve.server.generation import ServerState
from pdserve.server.metrics import ServerMetrics
from tests.unit.server.test_worker_errors import COLOCATED, LetterTokenizer


class HangingEngine:
    """An engine whose requests never produce anything until they are closed."""

    def __init__(self):
        self.healthy = True
        self.health_detail = "running"
        self.num_in_flight = 0
        self.stats = SimpleNamespace(num_running=0)
        self.ready = SimpleNamespace(vocab_size=64, model_path="unused")
        self.started = asyncio.Event()
        self.closed: list[str] = []

    async def generate(self, request_id, prompt_ids, sampling, bootstrap=None):
        self.started.set()
        try:
            await asyncio.Event().wait()
            yield  # NOTE: never reached: an async generator
        finally:
            self.closed.append(request_id)

    def cancel(self, request_id: str, reason: str) -> bool:
        return False

    def in_flight(self, request_id: str) -> bool:
        return False


async def _leave_during(path: str, body: dict) -> tuple[list[dict], HangingEngine, float]:
    """POST `body` to a worker app and leave once the engine has the request."""
    engine = HangingEngine()
    app = build_app(EngineConfig(model_path="unused"), COLOCATED)
    metrics = ServerMetrics("tiny")
    app.state.pdserve = ServerState(
        client=engine,
        tokenizer=LetterTokenizer(),
        served_model_name="tiny",
        max_model_len=32,
        metrics=metrics,
        max_queued_requests=4,
        role=COLOCATED,
    )
    messages = [{"type": "http.request", "body": json.dumps(body).encode()}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await engine.started.wait()
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "server": ("test", 80),
        "client": ("client", 1),
        "headers": [(b"content-type", b"application/json")],
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    aborts = metrics._success.labels(**metrics._labels, finished_reason="abort")._value.get()
    return sent, engine, aborts


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}}),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 4}),
    ],
)
def test_a_client_leaving_a_whole_answer_is_an_info_line_and_one_abort(caplog, path, body):
    caplog.set_level(logging.INFO)
    sent, engine, aborts = asyncio.run(_leave_during(path, body))
    assert sent[0]["status"] == 499
    assert len(engine.closed) == 1, "the engine request was not closed"
    assert aborts == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("the client left" in r.getMessage() for r in caplog.records)
