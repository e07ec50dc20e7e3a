"""A worker's errors that no engine is needed for: the HTTP framework's own (a crash in a
handler) in OpenAI's shape, and an engine's typed failures as HTTP errors (a fake engine
client). The app is built but not started (no engine process)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from pdserve.colocated.worker import build_worker
from pdserve.edge.api_errors import error_type
from pdserve.engine.core.config import EngineConfig
from pdserve.protocol.engine_messages import TokenOutput
from pdserve.protocol.failures import OUTCOMES, Failure, FailureKind, FailureStage
from pdserve.server.app import build_app
from pdserve.server.generation import ServerState
from pdserve.server.metrics import ServerMetrics
from pdserve.server.role import WorkerRole

COLOCATED = WorkerRole("colocated", build_worker)


def test_a_bug_in_a_handler_is_an_openai_500():
    app = build_app(EngineConfig(model_path="unused"), COLOCATED)

    @app.get("/broken")
    async def broken():
        raise RuntimeError("a bug")

    client = TestClient(app, raise_server_exceptions=False)  # NOTE: no lifespan, no engine
    response = client.get("/broken")
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error == {
        "message": "internal error in the worker; its log has the traceback",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }


def test_a_field_of_several_types_is_named_with_the_types_it_takes():
    """`prompt` is a string, a list of strings, token ids or token-id lists: an error names
    the field (not pydantic's `prompt.str`) and the types it takes."""
    app = build_app(EngineConfig(model_path="unused"), COLOCATED)
    client = TestClient(app, raise_server_exceptions=False)
    cases = [
        ({"prompt": ["hi", 3]}, "prompt", "an array"),
        ({"prompt": 7}, "prompt", "an integer"),
        ({"prompt": "x", "stop": [1]}, "stop", "an array"),
    ]
    for body, param, kind in cases:
        error = client.post("/v1/completions", json=body).json()["error"]
        assert error["param"] == param, error
        assert error["message"].startswith(f"{param}: expected one of: "), error
        assert "str" in error["message"] and kind in error["message"], error
    nested = client.post(
        "/v1/completions", json={"prompt": "x", "stream_options": {"include_usage": 1}}
    )
    assert nested.json()["error"]["param"] == "stream_options.include_usage"


class FailingEngine:
    """What the HTTP layer uses of an EngineClient; every request fails with `failure`, and
    with `dies` the engine is gone (unhealthy) by the time the failure arrives."""

    def __init__(self):
        self.failure: Failure | None = None
        self.dies = False
        self.healthy = True
        self.health_detail = "running"
        self.num_in_flight = 0
        self.stats = SimpleNamespace(num_running=0)
        self.ready = SimpleNamespace(vocab_size=64, model_path="unused")

    async def generate(self, request_id, prompt_ids, sampling, bootstrap=None):
        self.healthy = not self.dies
        yield TokenOutput(
            request_id, [], True, len(prompt_ids), 0, finish_reason="abort", failure=self.failure
        )

    def cancel(self, request_id: str, reason: str) -> bool:
        return False

    def in_flight(self, request_id: str) -> bool:
        return False


class LetterTokenizer:
    def decode(self, token_ids, skip_special_tokens=True, **kwargs) -> str:
        return "".join(chr(97 + t % 26) for t in token_ids)


@pytest.fixture(scope="module")
def failing_worker():
    app = build_app(EngineConfig(model_path="unused"), COLOCATED)
    engine = FailingEngine()
    app.state.pdserve = ServerState(
        client=engine,
        tokenizer=LetterTokenizer(),
        served_model_name="tiny",
        max_model_len=32,
        metrics=ServerMetrics("tiny"),
        max_queued_requests=4,
        role=COLOCATED,
    )
    return TestClient(app), engine  # NOTE: no lifespan, so no engine process starts


def _first_event(response) -> dict:
    return json.loads(next(line for line in response.iter_lines() if line)[len("data: ") :])


@pytest.mark.parametrize("kind", list(FailureKind))
def test_an_engine_failure_answers_with_its_kinds_status_and_code(failing_worker, kind):
    client, engine = failing_worker
    engine.failure = Failure(kind, FailureStage.ENGINE, f"the request failed ({kind})")
    status = OUTCOMES[kind].status
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    response = client.post("/generate", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"] == {
        "message": engine.failure.message,
        "type": error_type(status),
        "param": None,
        "code": kind.value,
    }
    body = {"prompt": [1, 2], "max_tokens": 2, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as streamed:
        assert streamed.status_code == 200
        assert _first_event(streamed)["error"]["code"] == kind.value


def test_a_failure_after_the_engine_died_is_unavailable(failing_worker):
    client, engine = failing_worker
    engine.failure = Failure(FailureKind.INTERNAL, FailureStage.ENGINE, "step raised")
    engine.dies = True
    try:
        response = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    finally:
        engine.dies, engine.healthy = False, True
    assert response.status_code == OUTCOMES[FailureKind.UNAVAILABLE].status, response.text
    error = response.json()["error"]
    assert error["code"] == "unavailable" and error["message"] == "engine unavailable: step raised"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": 10**400}}),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "temperature": 10**400}),
    ],
)
def test_an_integer_sampling_value_past_float_range_is_a_400_naming_it(failing_worker, path, body):
    client, _ = failing_worker
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "temperature"
    # NOTE: an integer is a number; what is wrong is its size, in every API alike.
    assert error["message"] == "temperature: must be a finite number, got an integer beyond 64 bits"


def test_top_logprobs_out_of_range_is_a_400_naming_top_logprobs(failing_worker):
    client, _ = failing_worker
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    response = client.post("/v1/chat/completions", json=body | {"top_logprobs": 21})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "top_logprobs", error
    assert error["message"] == "top_logprobs: must be in [0, 20], got 21"


def test_vllms_continuous_usage_stats_is_refused_naming_it(failing_worker):
    """vLLM puts usage in every chunk for it; here it would be ignored, so it is refused."""
    client, _ = failing_worker
    body = {"prompt": [1, 2], "max_tokens": 2, "stream": True}
    asked = {"include_usage": True, "continuous_usage_stats": True}
    response = client.post("/v1/completions", json=body | {"stream_options": asked})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stream_options.continuous_usage_stats", error
    assert error["message"] == (
        "stream_options.continuous_usage_stats is not supported by this server; "
        "omit it or send false"
    )
    unused = {"include_usage": True, "continuous_usage_stats": False}
    with client.stream("POST", "/v1/completions", json=body | {"stream_options": unused}) as ok:
        assert ok.status_code == 200
