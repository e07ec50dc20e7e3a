"""`pdserve router --router-processes 2`, a real router in front of a colocated worker on a
loopback port: requests go through both processes and `/metrics` sums them whichever process
answers; a killed process is replaced while the router keeps serving; SIGTERM stops every
process and removes the metrics directory. Torch-free."""

from __future__ import annotations

import glob
import os
import signal
import tempfile

import httpx
import pytest

from pdserve.server.local_process import LocalServer
from tests.unit.fake_workers import CompletingWorker
from tests.waiting import wait_until

BODY = {"model": "m", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def worker():
    with CompletingWorker() as worker:
        yield worker


def _start(worker) -> LocalServer:
    flags = ["--router-processes", "2", "--health-check-interval", "0.2"]
    router = LocalServer(["router", "--worker-urls", worker.url, *flags])

    def serving() -> bool:
        assert router.process.poll() is None, "the router exited"
        return len(_children(router)) == 2 and _ok(router)

    wait_until(serving, "two router processes serving", 60, retry_on=(httpx.TransportError,))
    return router


def _children(router: LocalServer) -> set[int]:
    pid = router.process.pid
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(p) for p in f.read().split()}


def _ok(router: LocalServer) -> bool:
    """One completion on a connection of its own (so the kernel picks a process anew)."""
    return httpx.post(router.url + "/v1/completions", json=BODY, timeout=10).status_code == 200


def _requests_total(router: LocalServer) -> float:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('pdserve_router:requests_total{endpoint="/v1/completions"')
    )


@pytest.fixture
def router(worker):
    router = _start(worker)
    yield router
    router.stop()


def test_requests_go_through_both_processes_and_metrics_add_up(router, worker):
    before = worker.posts
    served = _requests_total(router)
    assert all(_ok(router) for _ in range(40))
    assert worker.posts - before == 40
    # NOTE: 40 connections of their own all on one of two sockets: about 1 in 2**39. Each
    # read below lands on either process; each must see both processes' requests.
    assert {_requests_total(router) - served for _ in range(10)} == {40}


def test_a_killed_process_is_replaced_and_the_router_keeps_serving(router):
    before = _children(router)
    os.kill(min(before), signal.SIGKILL)

    def replaced() -> set[int] | None:
        now = _children(router)
        return now if len(now) == 2 and now != before else None

    after = wait_until(replaced, "a new router process in place of the killed one", 30)
    assert len(after & before) == 1
    assert all(_ok(router) for _ in range(20))


def test_sigterm_stops_every_process_and_removes_the_metrics(worker):
    pattern = os.path.join(tempfile.gettempdir(), "pdserve-router-metrics-*")
    dirs_before = set(glob.glob(pattern))
    router = _start(worker)
    children = _children(router)
    assert len(set(glob.glob(pattern)) - dirs_before) == 1
    router.process.send_signal(signal.SIGTERM)
    assert router.process.wait(timeout=30) == 0
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")]
    assert set(glob.glob(pattern)) == dirs_before
