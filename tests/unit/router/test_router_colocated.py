"""The router in colocated mode (`--worker-urls`): each request, as it is, on one `pdserve
serve` worker picked by the policy. Fake workers behind an httpx transport; no torch."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from fastapi.testclient import TestClient

from pdserve.commands.router import router_config_from_args
from pdserve.router.app import build_router_app
from pdserve.router.config import RouterConfig
from tests.unit.fake_workers import completion, router_metric, worker_error

WORKERS = ("http://worker-a", "http://worker-b")
BODY = {"prompt": "hi", "max_tokens": 2}


class FakeServeWorkers:
    """Colocated workers `http://worker-a` and `http://worker-b`: /health and /v1/models
    answer; a POST runs `answer(host, body)`. Records each POST as (host, path, body)."""

    def __init__(self, answer=None):
        self.answer = answer or (lambda host, body: _echo(host, body))
        self.posts: list[tuple[str, str, dict]] = []
        self.cancelled: list[str] = []
        self.transport = httpx.MockTransport(self._handle)

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.method == "GET":
            if request.url.path == "/v1/models":
                return httpx.Response(200, json={"data": [{"id": f"model-on-{host}"}]})
            return httpx.Response(200 if request.url.path == "/health" else 404)
        body = json.loads(request.content)
        self.posts.append((host, request.url.path, body))
        try:
            return await self.answer(host, body)
        except asyncio.CancelledError:
            self.cancelled.append(host)
            raise


async def _echo(host: str, body: dict) -> httpx.Response:
    if body.get("stream"):
        events = [{"choices": [{"text": host}]}, {"choices": [{"text": "!"}]}]
        data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        return httpx.Response(200, content=data + b"data: [DONE]\n\n")
    return completion(host)


def _router(fakes: FakeServeWorkers, **options) -> TestClient:
    options.setdefault("health_check_interval_s", 60.0)  # NOTE: one check, at start-up
    config = RouterConfig(worker_urls=WORKERS, **options)
    return TestClient(build_router_app(config, fakes.transport))


@pytest.fixture(scope="module")
def router():
    fakes = FakeServeWorkers()
    with _router(fakes) as client:
        yield client, fakes


def test_requests_take_turns_on_the_workers_and_go_as_they_are(router):
    client, fakes = router
    fakes.posts.clear()
    body = {"prompt": ["one", "two"], "n": 2, "max_tokens": 2}  # NOTE: never split here
    texts = [client.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in "ab"]
    assert sorted(texts) == ["worker-a", "worker-b"]
    assert [(path, sent) for _, path, sent in fakes.posts] == [("/v1/completions", body)] * 2


def test_a_stream_comes_through_byte_for_byte(router):
    client, _ = router
    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(response.iter_raw())
    host = json.loads(raw.split(b"\n\n")[0][6:])["choices"][0]["text"]
    expected = b"".join(
        b"data: " + json.dumps(e).encode() + b"\n\n"
        for e in ({"choices": [{"text": host}]}, {"choices": [{"text": "!"}]})
    )
    assert raw == expected + b"data: [DONE]\n\n"


def test_health_workers_models_and_metrics_name_the_colocated_workers(router):
    client, _ = router
    assert client.get("/health").status_code == 200
    pools = client.get("/workers").json()
    assert list(pools) == ["colocated"]
    assert [w["url"] for w in pools["colocated"]] == list(WORKERS)
    assert client.get("/v1/models").json()["data"][0]["id"] == "model-on-worker-a"
    assert 'role="colocated",url="http://worker-b"' in client.get("/metrics").text


def test_the_access_line_names_the_worker(router, caplog):
    client, _ = router
    with caplog.at_level(logging.INFO, logger="pdserve.router.access"):
        client.post("/v1/completions", json=BODY, headers={"X-Request-Id": "colo-1"})
    (line,) = [r.getMessage() for r in caplog.records if "colo-1" in r.getMessage()]
    assert " worker=http://worker-" in line and "prefill=" not in line


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_worker_is_retried_on_the_other_and_a_request_error_is_not(stream):
    async def answer(host, body):
        if body["prompt"] == "bad":
            return worker_error(400, "bad prompt", "invalid_request_error")
        if host == "worker-a":
            return worker_error(503, "the engine failed", "server_error", "engine_failed")
        return await _echo(host, body)

    fakes = FakeServeWorkers(answer)
    with _router(fakes) as client:
        for _ in range(2):  # NOTE: round robin starts on either worker
            response = client.post("/v1/completions", json={**BODY, "stream": stream})
            assert response.status_code == 200 and "worker-b" in response.text
        response = client.post("/v1/completions", json={**BODY, "prompt": "bad"})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "bad prompt"
        retries = router_metric(client, "retries_total")
    failed = [
        host for host, _, sent in fakes.posts if sent["prompt"] == "hi" and host == "worker-a"
    ]
    assert retries == len(failed) >= 1  # NOTE: each failure retried once, on worker-b
    assert len([sent for _, _, sent in fakes.posts if sent["prompt"] == "bad"]) == 1


def test_a_client_that_leaves_before_the_first_byte_cancels_the_request_on_its_worker():
    reached = asyncio.Event()

    async def hang(host, body):
        reached.set()
        await asyncio.Event().wait()  # NOTE: only a cancellation ends it

    async def run():
        fakes = FakeServeWorkers(hang)
        app = build_router_app(RouterConfig(worker_urls=WORKERS[:1]), fakes.transport)
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport) as c:
            request = asyncio.ensure_future(c.post("http://router/v1/completions", json=BODY))
            await asyncio.wait_for(reached.wait(), 10)
            request.cancel()  # NOTE: the client leaves
            async with asyncio.timeout(10):
                while not fakes.cancelled:
                    await asyncio.sleep(0.01)
            workers = (await c.get("http://router/workers")).json()
        return fakes, workers

    fakes, workers = asyncio.run(run())
    assert fakes.cancelled == ["worker-a"]
    assert [p for _, p, _ in fakes.posts] == ["/v1/completions"]  # NOTE: no /abort_room
    assert workers["colocated"][0]["in_flight"] == 0


def test_colocated_and_prefill_decode_workers_are_exclusive_and_named():
    with pytest.raises(ValueError, match=r"--worker-urls .* and --prefill/--decode .* exclusive"):
        RouterConfig(worker_urls=WORKERS, prefill=(("http://p:1", 8998),), decode=("http://d",))
    with pytest.raises(ValueError, match=r"--worker-urls .* and --decode-service"):
        RouterConfig(worker_urls=WORKERS, decode_services=("dns",))
    with pytest.raises(ValueError, match="must start with http"):
        RouterConfig(worker_urls=("worker-a:8000",))


def test_the_command_line_takes_worker_urls_and_the_policy():
    from pdserve.cli import build_parser

    args = build_parser().parse_args(
        ["router", "--worker-urls", *WORKERS, "--policy", "least_load"]
    )
    config = router_config_from_args(args)
    assert config.worker_urls == WORKERS and config.policy == "least_load"
    assert config.colocated
