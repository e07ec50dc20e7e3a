"""A worker whose engine process dies starts a new one: /health says so meanwhile, then the
worker serves again. A prefill worker's engine owns the bootstrap listener; the new engine
binds the same port again. (The colocated case, with a stream failing when its engine is
killed, is in test_streams_and_failures.)"""

from __future__ import annotations

import os
import signal
import socket

from pdserve.server.local_process import LocalServer, free_port
from tests.e2e.conftest import START_DEADLINE_S, Server, engine_pid
from tests.e2e.pd_cluster import wait_until

RESTART_DEADLINE_S = 120.0


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_prefill_engine_restarts_on_its_bootstrap_port(tiny_model_dirs):
    port = free_port()
    args = ["prefill", "--model-path", tiny_model_dirs("llama"), "--device", "cpu"]
    local = LocalServer([*args, "--bootstrap-port", str(port)])
    prefill = Server(local.wait_healthy(START_DEADLINE_S), tiny_model_dirs("llama"))
    try:
        assert _listening(port)
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
    finally:
        local.stop()
