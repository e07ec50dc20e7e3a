"""Many concurrent streams with disconnects; the engine dying mid-stream."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from tests.e2e.conftest import engine_pid, start_server, stop_server
from tests.waiting import wait_until


def stream_completion(server, prompt, max_tokens, stop_after=None):
    """Stream one completion; close the connection after `stop_after` events if given.
    Returns (events received, finished normally)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    events = 0
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return events, True
            events += 1
            if stop_after is not None and events >= stop_after:
                return events, False  # leaving the block drops the connection
    return events, False


def test_32_streams_some_disconnecting_leave_the_kv_cache_empty(server):
    results: dict[int, tuple[int, bool]] = {}

    def run(i):
        stop_after = 3 if i % 4 == 0 else None
        results[i] = stream_completion(server, [5 + i] * (10 + i), 60, stop_after)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 32
    for i, (events, finished) in results.items():
        if i % 4 == 0:
            assert not finished
        else:
            assert finished and events >= 1, (i, events)
    wait_until(lambda: server.metric("kv_cache_pages_used") == 0, "KV pages to be freed")
    wait_until(lambda: server.metric("num_requests_running") == 0, "no running requests")
    assert server.get("/health").status_code == 200


def aborted_count(server) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("pdserve:request_success_total") and '"abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture
def doomed(tiny_model_dirs):
    server = start_server(tiny_model_dirs("llama"))
    yield server
    stop_server(server)


def test_disconnected_stream_is_aborted(doomed):
    # NOTE: a fresh server and a 2000-token request: it cannot finish on its own before the
    # disconnect is noticed, even on a loaded machine, so only an abort ends it early.
    _, finished = stream_completion(doomed, [9] * 30, 2000, stop_after=2)
    assert not finished
    wait_until(lambda: aborted_count(doomed) == 1, "the request to be aborted")
    wait_until(lambda: doomed.metric("kv_cache_pages_used") == 0, "abort to free pages")


def test_engine_death_fails_streams_with_an_sse_error_and_the_engine_restarts(doomed):
    body = {
        "prompt": [5] * 10,
        "max_tokens": 2000 - 20,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    lines = []
    with httpx.stream("POST", doomed.url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if len(lines) == 3:
                    os.kill(engine_pid(doomed), signal.SIGKILL)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["type"] == "server_error" and "engine" in error["message"]
    assert "Traceback" not in error["message"]
    health = doomed.get("/health")
    if health.status_code == 503:  # unless the restart already finished
        assert health.text.startswith("engine restarting after: engine process exited")
        after = doomed.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert after.status_code in (200, 503) and after.json()
    # The front end starts a new engine process; it serves again.
    wait_until(lambda: doomed.get("/health").status_code == 200, "the restart", 120)
    after = doomed.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert after.status_code == 200, after.text


def test_engine_exits_when_the_front_end_is_killed(doomed):
    pid = engine_pid(doomed)
    doomed.process.kill()  # SIGKILL the front end alone; the engine is orphaned
    doomed.process.wait(timeout=10)
    wait_until(
        lambda: _state(pid) in ("gone", "Z"),
        "the engine process to exit after its front end",
        10,
        describe=lambda: f"engine process {pid} in state {_state(pid)}",
    )


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
