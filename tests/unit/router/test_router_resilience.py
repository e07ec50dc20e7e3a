"""The router against hostile clients and flaky workers: oversized bodies, stale keep-alive
connections, workers that answer 429, clients that leave before the first byte, its own
per-worker bound. Fake workers (tests/unit/fake_workers.py); no torch, no engine."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from pdserve.protocol.log_limit import RateLimitedLog
from pdserve.router.access_log import AccessRecord
from pdserve.router.app import build_router_app
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import Discovery
from pdserve.router.health import HealthChecker
from pdserve.router.intake import ClientWatch
from pdserve.router.legs import Legs, TransportLegClient
from pdserve.router.metrics import RouterMetrics
from pdserve.router.proxy import Proxy
from pdserve.router.routes import PairRoute
from pdserve.router.workers import Role, Worker, WorkerPool
from pdserve.server.local_process import LocalServer
from tests.unit.fake_workers import (
    FakeWorkers,
    KeepAliveDropper,
    completion,
    router_metric,
    worker_error,
)
from tests.waiting import wait_until

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


BODY = {"prompt": "hi", "max_tokens": 2}


def _healthy(client: TestClient) -> dict[str, list[bool]]:
    pools = client.get("/workers").json()
    return {role: [w["healthy"] for w in workers] for role, workers in pools.items()}


# ---- keep-alive connections the worker closed -----------------------------------------


def test_a_worker_that_drops_reused_connections_stays_in_rotation():
    """Every POST on a reused connection is dropped unanswered: the router sends it again
    on a new connection, without a retry on a new pair and without evicting the worker."""
    with KeepAliveDropper() as worker:
        config = RouterConfig(
            prefill=((worker.url, 8998),), decode=(worker.url,), health_check_interval_s=60
        )
        with TestClient(build_router_app(config)) as client:
            for i in range(10):
                response = client.post("/v1/completions", json=BODY)
                assert response.status_code == 200, (i, response.text)
            assert _healthy(client) == {"prefill": [True], "decode": [True]}
            assert router_metric(client, "retries_total") == 0


def test_a_worker_that_fails_every_time_leaves_rotation_after_failures_in_a_row():
    """A prefill worker that drops every request: the request and its retry fail (two
    failures in a row: out of rotation); the decode worker, never at fault, stays in."""
    with KeepAliveDropper("drop_all") as prefill, KeepAliveDropper("hang") as decode:
        config = RouterConfig(
            prefill=((prefill.url, 8998),), decode=(decode.url,), health_check_interval_s=60
        )
        with TestClient(build_router_app(config)) as client:
            response = client.post("/v1/completions", json=BODY)
            assert response.status_code == 502
            assert "unreachable: RemoteProtocolError" in response.json()["error"]["message"]
            assert router_metric(client, "retries_total") == 1
            assert _healthy(client) == {"prefill": [False], "decode": [True]}
            response = client.post("/v1/completions", json=BODY)
            assert response.status_code == 503
            assert "no healthy prefill worker" in response.json()["error"]["message"]


def test_failures_count_in_a_row_and_a_success_resets_them():
    pool = WorkerPool(Role.DECODE, [Worker("http://d:1", Role.DECODE)])
    worker = pool.workers[0]
    assert not pool.note_failure(worker, "reset", threshold=2)
    pool.note_success(worker)
    assert not pool.note_failure(worker, "reset", threshold=2)
    assert worker.healthy and worker.last_error is None
    assert pool.note_failure(worker, "reset again", threshold=2)
    assert not worker.healthy and worker.last_error == "reset again"
    assert pool.mark(worker, True) and worker.failures == 0


def prefill_answering_once(released: threading.Event):
    """A fake prefill worker whose answer comes once `released` is set."""

    async def answer(body):
        while not released.is_set():
            await asyncio.sleep(0.005)
        return completion()

    return answer


def test_a_prefill_answer_that_comes_after_the_stream_ended_is_awaited_not_cut():
    """The decode leg answered (so the room's KV arrived) and its stream ended before the
    prefill leg's answer: that leg finishes in the background (its kept-alive connection
    then serves the next request) instead of being cut, and is counted in flight until then."""
    released = threading.Event()

    late_prefill = prefill_answering_once(released)

    async def decode(body):
        return httpx.Response(200, content=b'data: {"choices": []}\n\ndata: [DONE]\n\n')

    fakes = FakeWorkers(prefill=late_prefill, decode=decode)
    with TestClient(build_router_app(fakes.config(), fakes.transport)) as client:
        response = client.post("/v1/completions", json={**BODY, "stream": True})
        assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")

        def in_flight() -> list[int]:
            pools = client.get("/workers").json()
            return [w["in_flight"] for role in ("prefill", "decode") for w in pools[role]]

        assert in_flight() == [1, 0]
        released.set()
        wait_until(lambda: in_flight() == [0, 0], "the prefill leg to finish")
    assert fakes.cancelled == [] and fakes.aborted_rooms == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_answer_late_after_decode_is_not_cut_before_the_request_deadline(
    stream, monkeypatch
):
    """A prefill leg that answers well after its room's decode leg: cut, the prefill worker
    would count a room that succeeded as an abort. It runs to its end, within the request's
    deadline (the router once cut it after a fixed 10 s grace, shortened here to show it)."""
    import pdserve.router.legs

    monkeypatch.setattr(pdserve.router.legs, "PREFILL_ANSWER_GRACE_S", 0.1, raising=False)
    answered = threading.Event()
    released = threading.Event()

    late_prefill = prefill_answering_once(released)

    async def decode(body):
        answered.set()
        if stream:
            return httpx.Response(200, content=b'data: {"choices": []}\n\ndata: [DONE]\n\n')
        return completion()

    fakes = FakeWorkers(prefill=late_prefill, decode=decode)
    config = fakes.config(request_timeout_s=30.0)
    with TestClient(build_router_app(config, fakes.transport)) as client:
        response = client.post("/v1/completions", json={**BODY, "stream": stream})
        assert response.status_code == 200
        late = time.monotonic() + 1.0
        wait_until(lambda: time.monotonic() > late, "the prefill leg to be late")
        assert fakes.cancelled == []
        released.set()
        wait_until(lambda: router_in_flight(client) == [0, 0], "the prefill leg to finish")
    assert answered.is_set() and fakes.cancelled == [] and fakes.aborted_rooms == []


def test_a_prefill_answer_late_past_the_request_deadline_is_cut():
    async def stuck_prefill(body):
        await asyncio.Event().wait()

    async def decode(body):
        return completion()

    fakes = FakeWorkers(prefill=stuck_prefill, decode=decode)
    with TestClient(build_router_app(fakes.config(request_timeout_s=1.0), fakes.transport)) as c:
        assert c.post("/v1/completions", json=BODY).status_code == 200
        wait_until(lambda: fakes.cancelled == ["prefill"], "the prefill leg to be cut")
        wait_until(lambda: router_in_flight(c) == [0, 0], "the prefill worker to be released")


def router_in_flight(client) -> list[int]:
    pools = client.get("/workers").json()
    return [w["in_flight"] for role in ("prefill", "decode") for w in pools[role]]


# ---- 4xx from a worker, and the router's own bound --------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_full_worker_answers_429_through_the_router_without_a_retry(stream):
    async def full(body):
        return worker_error(
            429, "the waiting queue is full", "rate_limit_error", "rate_limit_exceeded"
        )

    fakes = FakeWorkers(decode=full)
    with TestClient(build_router_app(fakes.config(), fakes.transport)) as client:
        response = client.post("/v1/completions", json={**BODY, "stream": stream})
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        assert router_metric(client, "retries_total") == 0
        assert _healthy(client) == {"prefill": [True], "decode": [True]}
    assert fakes.posts.count("decode") == 1


def test_a_request_error_from_prefill_is_not_retried_and_evicts_nobody():
    async def invalid(body):
        return worker_error(400, "seed must be below 2**64", "invalid_request_error")

    fakes = FakeWorkers(prefill=invalid)
    with TestClient(build_router_app(fakes.config(), fakes.transport)) as client:
        for _ in range(3):
            response = client.post("/v1/completions", json={**BODY, "seed": 2**64})
            assert response.status_code == 400 and "seed" in response.json()["error"]["message"]
        assert router_metric(client, "retries_total") == 0
        assert _healthy(client) == {"prefill": [True], "decode": [True]}


def test_the_router_bounds_requests_in_flight_per_worker_with_429():
    release = threading.Event()

    async def slow(body):
        await asyncio.to_thread(release.wait, 30)
        return completion()

    fakes = FakeWorkers(prefill=slow)
    config = fakes.config(max_requests_per_worker=1)
    with TestClient(build_router_app(config, fakes.transport)) as client:
        first: dict = {}
        thread = threading.Thread(
            target=lambda: first.update(r=client.post("/v1/completions", json=BODY))
        )
        thread.start()
        wait_until(
            lambda: client.get("/workers").json()["prefill"][0]["in_flight"] >= 1,
            "the first request to reach the worker",
            10,
            poll_s=0.01,
        )
        busy = client.post("/v1/completions", json=BODY)
        release.set()
        thread.join(timeout=10)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "rate_limit_exceeded"
        assert "--max-requests-per-worker" in busy.json()["error"]["message"]
        assert first["r"].status_code == 200
        assert client.post("/v1/completions", json=BODY).status_code == 200  # a slot again


def test_model_info_that_is_not_json_is_a_clear_502():
    fakes = FakeWorkers()  # NOTE: answers GET /v1/models with an empty 404
    with TestClient(build_router_app(fakes.config(), fakes.transport)) as client:
        response = client.get("/v1/models")
        assert response.status_code == 502
        assert "without JSON" in response.json()["error"]["message"]


# ---- a client that leaves before the first byte ---------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_before_the_first_byte_cancels_both_legs(stream):
    """Both legs hang (a prefill queue, a transfer); the client leaves: both are cancelled
    (their connections closed: the workers abort), nothing is retried, nothing stays
    counted in flight."""

    async def run():
        reached = {"prefill": asyncio.Event(), "decode": asyncio.Event()}

        def hang(role):
            async def leg(body):
                reached[role].set()
                await asyncio.Event().wait()  # NOTE: only a cancellation ends it

            return leg

        fakes = FakeWorkers(prefill=hang("prefill"), decode=hang("decode"))
        prefill = WorkerPool(Role.PREFILL, [Worker("http://prefill", Role.PREFILL, 8998)])
        decode = WorkerPool(Role.DECODE, [Worker("http://decode", Role.DECODE)])
        metrics = RouterMetrics()
        gone = asyncio.Event()
        config = fakes.config()
        legs = Legs(config, TransportLegClient(fakes.transport, fakes.transport, httpx.Timeout(5)))
        proxy = Proxy(config, PairRoute(config, legs, prefill, decode), metrics)
        body = {**BODY, "stream": stream}

        async def receive():  # NOTE: the body was read; what is left is the disconnect
            await gone.wait()
            return {"type": "http.disconnect"}

        async def handle():
            watch = ClientWatch(receive)
            headers = {"X-Request-Id": "x"}
            return await proxy.handle("/v1/completions", body, headers, watch, AccessRecord("x"))

        handling = asyncio.create_task(handle())
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in reached.values())), 10)
        gone.set()
        response = await asyncio.wait_for(handling, 10)
        await asyncio.sleep(0)  # NOTE: the cancelled prefill task ends on its next turn
        async with asyncio.timeout(10):
            while len(fakes.aborted_rooms) < 2:  # sent in the background
                await asyncio.sleep(0.01)
        in_flight = [w.in_flight for w in prefill.workers + decode.workers]
        return response.status_code, fakes, in_flight, metrics

    status, fakes, in_flight, metrics = asyncio.run(run())
    assert status == 499
    assert sorted(fakes.cancelled) == ["decode", "prefill"]
    # NOTE: a leg cut before it went out never reaches its worker: each is told by room.
    assert sorted(role for role, _ in fakes.aborted_rooms) == ["decode", "prefill"]
    assert len({room for _, room in fakes.aborted_rooms}) == 1
    assert in_flight == [0, 0]
    assert metrics.registry.get_sample_value("pdserve_router:retries_total") == 0


# ---- bodies ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_body_router():
    """A real router process (uvicorn) with a 1 MiB body limit and no worker to reach."""
    nowhere = "http://127.0.0.1:9"
    local = LocalServer(
        [
            "router",
            "--prefill",
            nowhere,
            "8998",
            "--decode",
            nowhere,
            "--max-body-size",
            str(1 << 20),
        ]
    )
    try:

        def live() -> bool:
            assert local.process.poll() is None, "the router exited"
            return httpx.get(local.url + "/liveness", timeout=2).status_code == 200

        wait_until(live, "the router to start", 60, poll_s=0.05, retry_on=(httpx.TransportError,))
        yield local
    finally:
        local.stop()


def _peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_body_over_the_limit_is_refused_as_it_streams_in(small_body_router):
    total = 256 << 20
    sent = 0

    def upload():
        nonlocal sent
        chunk = b" " * (1 << 20)
        while sent < total:
            sent += len(chunk)
            yield chunk

    peak_before = _peak_rss_bytes(small_body_router.process.pid)
    started = time.monotonic()
    response = httpx.post(small_body_router.url + "/v1/completions", content=upload(), timeout=30)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "body_too_large" and "--max-body-size" in error["message"]
    assert sent < total // 4, "the router read far past its limit"
    assert time.monotonic() - started < 10
    assert _peak_rss_bytes(small_body_router.process.pid) - peak_before < 32 << 20


def test_a_declared_content_length_over_the_limit_is_refused_before_any_byte(small_body_router):
    port = int(small_body_router.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
            b"Content-Type: application/json\r\nContent-Length: 419430400\r\n\r\n"
        )
        reply = b""
        while chunk := conn.recv(65536):  # NOTE: the router closes the connection after it
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"body_too_large" in reply


def test_a_body_under_the_limit_still_goes_through_checks(small_body_router):
    response = httpx.post(small_body_router.url + "/v1/completions", content=b"{oops", timeout=10)
    assert response.status_code == 400 and "invalid JSON" in response.json()["error"]["message"]


# ---- logs ---------------------------------------------------------------------------------


def test_repeated_warnings_are_rate_limited_per_key(caplog):
    now = [0.0]
    log = RateLimitedLog(
        logging.getLogger("test.router"), per_second=1 / 60, burst=1, clock=lambda: now[0]
    )
    decode, prefill = ("decode", 503), ("prefill", 502)
    with caplog.at_level(logging.WARNING, logger="test.router"):
        assert log.warning("leg failed: %s", "a", key=decode)
        assert not log.warning("leg failed: %s", "b", key=decode)
        assert not log.warning("leg failed: %s", "c", key=decode)
        assert log.warning("other key", key=prefill)
        now[0] = 60.0
        assert log.warning("leg failed: %s", "d", key=decode)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "leg failed: a",
        "other key",
        "leg failed: d (2 similar lines suppressed)",
    ]


def test_a_worker_is_in_rotation_at_first_and_back_in_rotation_after_leaving(caplog):
    answers = iter([200, 503, 200])

    def health(request: httpx.Request) -> httpx.Response:
        return httpx.Response(next(answers))

    worker = Worker("http://w", Role.COLOCATED, healthy=False)
    pool = WorkerPool(Role.COLOCATED, [worker])
    config = RouterConfig(worker_urls=("http://w",), health_failure_threshold=1)

    async def three_rounds() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(health)) as client:
            checker = HealthChecker(config, [pool], client, Discovery([], timeout_s=1))
            for _ in range(3):
                await checker.check_all()

    with caplog.at_level(logging.INFO, logger="pdserve.router.health"):
        asyncio.run(three_rounds())
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "colocated worker http://w is in rotation",
        "colocated worker http://w out of rotation: /health answered 503",
        "colocated worker http://w is back in rotation",
    ], lines
