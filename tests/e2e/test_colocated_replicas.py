"""`pdserve router --worker-urls`: two colocated `pdserve serve` workers (the session's and one
more, same tiny model and settings) behind the router. What goes through it is what a worker
answers directly, and the requests spread over both workers."""

from __future__ import annotations

import httpx
import pytest

from pdserve.server.local_process import LocalServer
from tests.e2e.answers import without_cached_tokens
from tests.e2e.conftest import START_DEADLINE_S, Server, start_server, stop_server
from tests.e2e.sse import stream_post


@pytest.fixture(scope="module")
def colocated(server, tiny_model_dirs):
    other = start_server(tiny_model_dirs("llama"), "--max-model-len", "512")
    try:
        route = ["router", "--worker-urls", server.url, other.url, "--health-check-interval", "0.5"]
        router = Server(LocalServer(route).wait_healthy(START_DEADLINE_S), server.model_path)
        try:
            yield router, [server, other]
        finally:
            router.local.stop()
    finally:
        stop_server(other)


def test_answers_through_the_router_are_the_workers_own_and_spread_over_both(colocated):
    router, workers = colocated
    body = {"prompt": [[5, 6, 7], [9, 10]], "n": 2, "max_tokens": 4, "temperature": 0}
    direct = workers[0].post("/v1/completions", body).json()
    before = [w.metric("generation_tokens_total") for w in workers]
    routed = [router.post("/v1/completions", body).json() for _ in workers]
    for answer in routed:
        assert [c["text"] for c in answer["choices"]] == [c["text"] for c in direct["choices"]]
        assert without_cached_tokens(answer["usage"]) == without_cached_tokens(direct["usage"])
    after = [w.metric("generation_tokens_total") for w in workers]
    assert [b - a for a, b in zip(before, after, strict=True)] == [16, 16]


def test_a_stream_through_the_router_is_the_workers_own(colocated):
    router, workers = colocated
    chat = {
        "model": router.model_path,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, direct = stream_post(workers[1].url + "/v1/chat/completions", chat)
    status_routed, routed = stream_post(router.url + "/v1/chat/completions", chat)
    assert status == status_routed == 200
    assert [e["choices"] for e in routed] == [e["choices"] for e in direct]
    assert without_cached_tokens(routed[-1]["usage"]) == without_cached_tokens(direct[-1]["usage"])


def test_the_router_serves_health_models_and_its_errors(colocated):
    router, workers = colocated
    assert router.get("/health").status_code == 200
    assert router.get("/version").json() == workers[0].get("/version").json()
    models = router.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [router.model_path]
    pools = router.get("/workers").json()
    assert sorted(w["url"] for w in pools["colocated"]) == sorted(w.url for w in workers)
    response = router.post("/v1/completions", {"prompt": "hi", "max_tokens": -1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    response = httpx.post(router.url + "/v1/completions", content=b"{oops", timeout=10)
    assert response.status_code == 400 and "invalid JSON" in response.json()["error"]["message"]
