"""SIGTERM, the way Kubernetes stops a pod (to the server process only): new connections are
refused at once, a stream in flight runs to its end within `--shutdown-timeout`, then the
server and its engine process exit."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx

from tests.e2e.conftest import start_server, stop_server
from tests.waiting import wait_until

MAX_TOKENS = 1200


def _refused(url: str) -> bool:
    """No new connection is served: refused, or (caught in the backlog as the listening
    socket closed) reset before any answer."""
    try:
        httpx.get(url + "/health", timeout=2)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return True
    return False


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_stream_in_flight_finishes_after_sigterm(tiny_model_dirs):
    server = start_server(
        tiny_model_dirs("llama"), "--shutdown-timeout", "60", "--max-model-len", "2048"
    )
    body = {
        "model": server.model_path,
        "prompt": "once upon a time",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    first_event = threading.Event()
    received: list = []
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as reply:
            assert reply.status_code == 200
            lines = reply.iter_lines()
            for line in lines:
                if line.startswith("data:"):
                    first_event.set()
                    break
            os.kill(server.process.pid, signal.SIGTERM)  # the server alone, not its group
            wait_until(lambda: _refused(server.url), "new connections refused after SIGTERM", 10)
            for line in lines:  # the rest of the same stream
                data = line[5:].strip() if line.startswith("data:") else ""
                if data == "[DONE]":
                    break
                if data:
                    received.append(json.loads(data))
        assert first_event.is_set()
        text_chunks = [e for e in received if e["choices"] and e["choices"][0]["text"]]
        finish = [e["choices"][0]["finish_reason"] for e in received if e["choices"]]
        assert finish[-1] == "length", finish[-3:]
        assert len(text_chunks) >= MAX_TOKENS // 2  # the stream was not cut short
        assert server.process.wait(timeout=60) in (0, 128 + signal.SIGTERM, -signal.SIGTERM)
        # The engine process (same process group) exits with its server.
        wait_until(lambda: _group_gone(server.process.pid), "the engine process to exit", 20)
    finally:
        stop_server(server)
