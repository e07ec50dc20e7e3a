"""A worker's errors that no engine is needed for: the HTTP framework's own (a crash in a
handler) in OpenAI's shape. The app is built but not started (no engine process)."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient

from pdserve.engine.config import EngineConfig
from pdserve.server.app import build_app


def test_a_bug_in_a_handler_is_an_openai_500():
    app = build_app(EngineConfig(model_path="unused"))
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
