"""A worker that stops answering while its host still accepts its connections (SIGSTOP, a
wedged process): the router's health checks time out, it leaves rotation, and the requests
already sent to it end then, retried on another worker since nothing was relayed, instead of
waiting for the request deadline. Real loopback workers, the router's own HTTP/1.1 legs."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from pdserve.router.app import build_router_app
from pdserve.router.config import RouterConfig
from tests.unit.fake_workers import CompletingWorker, StoppableWorker
from tests.waiting import wait_until

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


BODY = {"prompt": "hi", "max_tokens": 2}
REQUEST_TIMEOUT_S = 30.0


def test_requests_on_a_worker_that_stopped_answering_are_retried_elsewhere_soon():
    with StoppableWorker() as stopping, CompletingWorker() as healthy:
        config = RouterConfig(
            worker_urls=(stopping.url, healthy.url),
            policy="round_robin",
            health_check_interval_s=0.2,
            health_check_timeout_s=0.5,
            request_timeout_s=REQUEST_TIMEOUT_S,
        )
        with TestClient(build_router_app(config)) as client:
            for _ in range(2):
                assert client.post("/v1/completions", json=BODY).status_code == 200
            # NOTE: one each, so round robin sends the next one to `stopping`
            assert stopping.server.posts == healthy.posts == 1
            stopping.stop()
            started = time.monotonic()
            response = client.post("/v1/completions", json=BODY)
            took = time.monotonic() - started
            assert response.status_code == 200, response.text
            assert took < REQUEST_TIMEOUT_S / 3, f"the request waited {took:.1f} s"
            workers = client.get("/workers").json()["colocated"]
            assert [w["healthy"] for w in workers] == [False, True]
            wait_until(lambda: client.get("/workers").json()["colocated"][0]["in_flight"] == 0,
                       "the stopped worker's leg to be released")  # fmt: skip


def test_a_stream_from_a_worker_that_stopped_answering_ends_with_an_error_event_soon():
    with StoppableWorker() as stopping:
        config = RouterConfig(
            worker_urls=(stopping.url,),
            health_check_interval_s=0.2,
            health_check_timeout_s=0.5,
            request_timeout_s=REQUEST_TIMEOUT_S,
        )
        with TestClient(build_router_app(config)) as client:
            body = {**BODY, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")  # NOTE: the stream started
                stopping.stop()
                started = time.monotonic()
                rest = [line for line in lines if line]
                took = time.monotonic() - started
            assert took < REQUEST_TIMEOUT_S / 3, f"the stream waited {took:.1f} s"
            assert "stopped answering" in rest[0] and rest[-1] == "data: [DONE]", rest
