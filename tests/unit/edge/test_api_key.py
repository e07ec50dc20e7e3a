"""The API key check both apps share (edge/api_key.py): what it refuses and lets through,
and that neither app wraps its responses in an `http` middleware function (starlette's
BaseHTTPMiddleware), which routes every streamed chunk through memory streams of its own and
made a worker's front end the bottleneck of a streaming benchmark (RESULTS.md, issue 21)."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.middleware.base import BaseHTTPMiddleware

from pdserve.colocated.worker import build_worker
from pdserve.edge.api_key import ApiKeyMiddleware
from pdserve.engine.core.config import EngineConfig
from pdserve.router.app import build_router_app
from pdserve.server.app import build_app
from pdserve.server.role import WorkerRole
from tests.unit.fake_workers import FakeWorkers


def call(middleware: ApiKeyMiddleware, path: str, headers=(), kind: str = "http"):
    """The messages the middleware sent, and whether it passed the request on."""
    sent, passed = [], []

    async def inner(scope, receive, send):
        passed.append(scope["path"])

    middleware.app = inner

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": kind, "path": path, "headers": list(headers)}
    asyncio.run(middleware(scope, receive, send))
    return sent, bool(passed)


def test_a_missing_or_wrong_key_is_refused_in_openai_shape():
    middleware = ApiKeyMiddleware(None, "sesame", {"/health"})
    for headers in ([], [(b"authorization", b"Bearer nope")], [(b"authorization", b"sesame")]):
        sent, passed = call(middleware, "/v1/completions", headers)
        assert not passed
        assert sent[0]["status"] == 401
        assert dict(sent[0]["headers"])[b"content-type"] == b"application/json"
        body = json.loads(sent[1]["body"])
        assert body["error"]["type"] == "authentication_error"
        assert body["error"]["code"] == "invalid_api_key"
        assert dict(sent[0]["headers"])[b"content-length"] == str(len(sent[1]["body"])).encode()


@pytest.mark.parametrize(
    "key, path, headers, kind",
    [
        ("sesame", "/v1/completions", [(b"authorization", b"Bearer sesame")], "http"),
        ("sesame", "/health", [], "http"),  # an open path
        ("sesame", "/v1/completions", [], "lifespan"),  # not a request
        (None, "/v1/completions", [], "http"),  # no key configured
    ],
)
def test_what_passes(key, path, headers, kind):
    sent, passed = call(ApiKeyMiddleware(None, key, {"/health"}), path, headers, kind)
    assert passed and sent == []


def test_neither_app_has_an_http_middleware_function():
    worker = build_app(
        EngineConfig(model_path="unused"), WorkerRole("colocated", build_worker), api_key="k"
    )
    router = build_router_app(FakeWorkers().config(api_key="k"), FakeWorkers().transport)
    for app in (worker, router):
        classes = [m.cls for m in app.user_middleware]
        assert ApiKeyMiddleware in classes
        assert not any(issubclass(c, BaseHTTPMiddleware) for c in classes), classes
