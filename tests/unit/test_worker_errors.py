"""A worker's errors that no engine is needed for: the HTTP framework's own (a crash in a
handler) in OpenAI's shape. The app is built but not started (no engine process)."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient

from pdserve.colocated.worker import build_worker
from pdserve.engine.config import EngineConfig
from pdserve.server.app import build_app
from pdserve.server.role import WorkerRole

COLOCATED = WorkerRole("colocated", build_worker)


def test_a_bug_in_a_handler_is_an_openai_500():
    app = build_app(EngineConfig(model_path="unused"), COLOCATED)
    app.state.pdserve = SimpleNamespace(api_key=None)  # NOTE: all the middleware reads

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
    app.state.pdserve = SimpleNamespace(api_key=None)
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
