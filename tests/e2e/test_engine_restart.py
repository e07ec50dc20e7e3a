"""A worker whose engine process dies starts a new one: /health says so meanwhile, then the
worker serves again. A prefill worker's engine owns the bootstrap listener: the new engine
binds the same port, and the decode worker, which had registered with the old engine,
notices the new instance and registers again, so requests through the router succeed with no
retry. (The colocated case, with a stream failing when its engine is killed, is in
test_streams_and_failures.)"""

from __future__ import annotations

import os
import signal
import socket

import httpx

from tests.e2e.conftest import engine_pid
from tests.e2e.pd_cluster import start_cluster
from tests.waiting import wait_until

RESTART_DEADLINE_S = 120.0


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _complete(cluster, i: int) -> None:
    body = {"prompt": f"hello {i}", "max_tokens": 4, "temperature": 0}
    response = cluster.router.post("/v1/completions", body)
    assert response.status_code == 200, response.text


def _router_retries(cluster) -> float:
    for line in httpx.get(cluster.router.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve_router:retries_total "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError("pdserve_router:retries_total")


def test_prefill_engine_restart_rebinds_its_port_and_decode_registers_again(tiny_model_dirs):
    cluster = start_cluster(tiny_model_dirs("llama"))
    prefill, port = cluster.prefill[0], cluster.bootstrap_ports[0]
    try:
        _complete(cluster, 0)  # the decode worker is now registered with this engine
        old_pid = engine_pid(prefill)
        os.kill(old_pid, signal.SIGKILL)
        wait_until(lambda: prefill.get("/health").status_code == 503, "/health 503", 20)
        health = prefill.get("/health")
        assert health.status_code == 200 or health.text.startswith("engine restarting after:")
        wait_until(
            lambda: prefill.get("/health").status_code == 200, "the restart", RESTART_DEADLINE_S
        )
        assert engine_pid(prefill) != old_pid
        assert prefill.get("/server_info").json()["disaggregation_bootstrap_port"] == port
        assert _listening(port)  # the old engine is gone: this is the new one's listener
        wait_until(lambda: _router_in_rotation(cluster), "the router to use prefill again", 20)
        retries = _router_retries(cluster)
        for i in range(1, 4):
            _complete(cluster, i)
        assert _router_retries(cluster) == retries
        cluster.wait_all_free()
    finally:
        cluster.stop()


def _router_in_rotation(cluster) -> bool:
    pools = httpx.get(cluster.router.url + "/workers", timeout=10).json()
    return all(w["healthy"] for pool in pools.values() for w in pool)
