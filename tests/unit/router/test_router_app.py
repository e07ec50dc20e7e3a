"""The router without workers to reach: torch-free imports, config checks, its own errors,
API key, health, and how it reads a leg's failure."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from pdserve.router.app import build_router_app
from pdserve.router.config import RouterConfig
from pdserve.router.errors import LegError, leg_error, raise_if_error_event
from tests.unit.fake_workers import FakeWorkers

UNREACHABLE = "http://127.0.0.1:9"  # discard port: nothing listens


def test_router_and_cli_import_without_torch():
    code = (
        "import sys, pdserve.router.app, pdserve.cli, pdserve.launch, pdserve.commands.router; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_router_config_names_what_is_wrong():
    with pytest.raises(ValueError, match="at least one --decode"):
        RouterConfig(prefill=(("http://a:1", None),), decode=())
    with pytest.raises(ValueError, match="http://"):
        RouterConfig(prefill=(("a:1", None),), decode=("http://b:2",))
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        RouterConfig(
            prefill=(("http://a:1", 8998),), decode=("http://b:2",), decode_policy="fastest"
        )
    with pytest.raises(ValueError, match="bootstrap port"):
        RouterConfig(prefill=(("http://a:1", 70000),), decode=("http://b:2",))
    workers = {"prefill": (("http://a:1", 8998),), "decode": ("http://b:2",)}
    with pytest.raises(ValueError, match="max_body_bytes must be positive"):
        RouterConfig(**workers, max_body_bytes=0)
    with pytest.raises(ValueError, match="max_requests_per_worker must be >= 0"):
        RouterConfig(**workers, max_requests_per_worker=-1)


def test_router_cli_passes_the_limits():
    from pdserve.cli import build_parser
    from pdserve.commands.router import router_config_from_args

    workers = ["--prefill", "http://a:1", "8998", "--decode", "http://b:2"]
    limits = ["--max-body-size", "1024", "--max-requests-per-worker", "8"]
    args = build_parser().parse_args(["router", *workers, *limits])
    config = router_config_from_args(args)
    assert (config.max_body_bytes, config.max_requests_per_worker) == (1024, 8)


def test_a_leg_error_is_retryable_only_for_worker_failures():
    body = b'{"error": {"message": "too long", "type": "invalid_request_error"}}'
    assert not leg_error("prefill", 400, body).retryable
    assert leg_error("decode", 503, b"not json").retryable
    assert "too long" in str(leg_error("prefill", 400, body))


def test_an_error_as_the_first_event_fails_the_leg():
    raise_if_error_event("decode", b'data: {"text": "hi"}\n\n')  # an ordinary first event
    transfer = b'data: {"error": {"message": "peer silent", "type": "server_error"}}\n\n'
    with pytest.raises(LegError) as failed:
        raise_if_error_event("decode", transfer)
    assert failed.value.retryable and failed.value.status == 503
    invalid = b'data: {"error": {"message": "bad", "type": "invalid_request_error"}}\n\n'
    with pytest.raises(LegError) as failed:
        raise_if_error_event("decode", invalid)
    assert not failed.value.retryable and failed.value.status == 400
    full = b'data: {"error": {"message": "queue full", "type": "rate_limit_error"}}\n\n'
    with pytest.raises(LegError) as failed:
        raise_if_error_event("decode", full)
    assert not failed.value.retryable and failed.value.status == 429


@pytest.fixture
def lonely_router():
    config = RouterConfig(
        prefill=((UNREACHABLE, 8998),),
        decode=(UNREACHABLE,),
        api_key="sesame",
        health_check_interval_s=0.2,
        health_check_timeout_s=0.5,
        connect_timeout_s=0.5,
    )
    with TestClient(build_router_app(config)) as client:
        yield client


def test_without_healthy_workers_the_router_says_so(lonely_router):
    assert lonely_router.get("/health").status_code == 503  # open without the key
    assert "pdserve_router:worker_healthy" in lonely_router.get("/metrics").text
    auth = {"Authorization": "Bearer sesame", "X-Request-Id": "req-42"}
    response = lonely_router.post("/v1/completions", json={"prompt": "hi"}, headers=auth)
    assert response.status_code == 503
    assert "no healthy prefill worker" in response.json()["error"]["message"]
    assert response.headers["x-request-id"] == "req-42"


def test_router_checks_its_api_key_and_the_body(lonely_router):
    assert lonely_router.post("/generate", json={"text": "hi"}).status_code == 401
    auth = {"Authorization": "Bearer sesame"}
    response = lonely_router.post("/generate", content=b"[1, 2]", headers=auth)
    assert response.status_code == 400 and "JSON object" in response.json()["error"]["message"]
    response = lonely_router.post("/generate", content=b"{oops", headers=auth)
    assert response.status_code == 400 and "invalid JSON" in response.json()["error"]["message"]
    for hostile, word in [
        (b'{"text": "hi", "sampling_params": {"temperature": NaN}}', "NaN"),
        (b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
        (b'{"text": "\\ud800"}', "surrogate"),
    ]:
        response = lonely_router.post("/generate", content=hostile, headers=auth)
        assert response.status_code == 400, response.text
        assert word in response.json()["error"]["message"]


def _openai_error(response, status: int, code: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error
    return error


def test_unknown_paths_and_wrong_methods_have_openai_errors(lonely_router):
    auth = {"Authorization": "Bearer sesame"}
    error = _openai_error(lonely_router.get("/v1/nowhere", headers=auth), 404, "not_found")
    assert "/v1/nowhere" in error["message"] and error["type"] == "invalid_request_error"
    for method, path, allowed in [
        ("GET", "/v1/completions", "POST"),
        ("PUT", "/generate", "POST"),
        ("POST", "/health", "GET"),  # an open path: no key needed
        ("POST", "/v1/models", "GET"),
    ]:
        response = lonely_router.request(method, path, headers=auth)
        error = _openai_error(response, 405, "method_not_allowed")
        assert response.headers["allow"] == allowed
        assert f"{method} is not allowed on {path}; use {allowed}" == error["message"]
    unauthorized = lonely_router.get("/v1/nowhere")  # the key is checked first
    _openai_error(unauthorized, 401, "invalid_api_key")


def test_a_body_over_the_limit_is_an_openai_413():
    config = RouterConfig(prefill=((UNREACHABLE, 8998),), decode=(UNREACHABLE,), max_body_bytes=64)
    with TestClient(build_router_app(config)) as client:
        response = client.post("/v1/completions", json={"prompt": "x" * 100})
        error = _openai_error(response, 413, "body_too_large")
        assert error["type"] == "invalid_request_error"


def test_a_bug_in_the_router_is_an_openai_500():
    async def broken(body):
        raise RuntimeError("a bug")

    fakes = FakeWorkers(prefill=broken)
    app = build_router_app(fakes.config(), fakes.transport)
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        error = _openai_error(response, 500, "internal_error")
        assert error["type"] == "server_error" and "a bug" not in error["message"]
