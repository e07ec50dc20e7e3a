"""SIGTERM, the way Kubernetes stops a pod (to the server process only) or systemd a service
(to its whole process group): new connections are refused at once, a stream in flight runs to
its end within `--shutdown-timeout`, then the server and its engine process exit."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from pdserve.server.local_process import LocalServer
from tests.e2e.conftest import START_DEADLINE_S, Server, start_server, stop_server
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


@pytest.mark.parametrize("to", ["server", "group"])
def test_a_stream_in_flight_finishes_after_sigterm(tiny_model_dirs, to):
    """SIGTERM to the server alone (Kubernetes), or to its whole process group (systemd's
    default stop, `kill -TERM -PGID`), which reaches the engine process too: the stream
    still runs to its end within the shutdown timeout."""
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
            if to == "server":
                os.kill(server.process.pid, signal.SIGTERM)
            else:
                os.killpg(server.process.pid, signal.SIGTERM)
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


# A prompt prefilled a token a step (--chunked-prefill-size 1): its request is still running
# whenever a short shutdown timeout passes.
SLOW_PREFILL = ("--chunked-prefill-size", "1", "--max-model-len", "2048")
SHORT_TIMEOUT = ("--shutdown-timeout", "0.5")


def _slow_body(token: int) -> dict:
    return {"prompt": [token] * 1800, "max_tokens": 8, "stream": True, "ignore_eos": True}


def _in_flight(worker: Server) -> float:
    return worker.metric("num_requests_running") + worker.metric("num_requests_waiting")


def _log_problems(path) -> list[str]:
    """Lines that would alarm an operator: errors, and uvicorn cancelling tasks."""
    lines = path.read_text().splitlines()
    return [line for line in lines if line.startswith(("ERROR", "CRITICAL")) or "Cancel" in line]


def test_what_still_runs_at_the_shutdown_timeout_ends_well_formed(tiny_model_dirs, tmp_path):
    """Router, then worker: SIGTERM while a request runs past --shutdown-timeout. The router's
    request, still waiting for its first token, gets a 503; the worker's stream an SSE error
    event and [DONE], its body ended cleanly; nothing is logged at ERROR (no "Cancel 1
    running task(s)", no "front end process is gone" from the worker's engine)."""
    model = tiny_model_dirs("llama")
    logs = {name: tmp_path / f"{name}.log" for name in ("worker", "router")}
    worker_args = ["serve", "--model-path", model, "--device", "cpu", *SLOW_PREFILL]
    local = LocalServer([*worker_args, *SHORT_TIMEOUT], log_level="info", log_path=logs["worker"])
    worker = Server(local.wait_healthy(START_DEADLINE_S), model)
    router_args = ["router", "--worker-urls", worker.url, *SHORT_TIMEOUT]
    router = LocalServer(router_args, log_level="info", log_path=logs["router"])
    try:
        router.wait_healthy(START_DEADLINE_S)
        answers: list[httpx.Response] = []
        url = router.url + "/v1/completions"
        sending = threading.Thread(
            target=lambda: answers.append(httpx.post(url, json=_slow_body(7), timeout=60))
        )
        sending.start()
        wait_until(lambda: _in_flight(worker) == 1, "the request to reach the worker", 30)
        os.kill(router.process.pid, signal.SIGTERM)
        sending.join(30)
        assert answers[0].status_code == 503, answers[0].text
        assert answers[0].json()["error"]["code"] == "unavailable"
        router.process.wait(timeout=30)
        wait_until(lambda: _in_flight(worker) == 0, "the worker to abort the request", 30)

        events = []
        url = worker.url + "/v1/completions"
        with httpx.stream("POST", url, json=_slow_body(8), timeout=60) as reply:
            assert reply.status_code == 200
            wait_until(lambda: _in_flight(worker) == 1, "the request to reach the engine", 30)
            os.kill(worker.process.pid, signal.SIGTERM)
            events = [line[5:].strip() for line in reply.iter_lines() if line.startswith("data:")]
        assert len(events) == 2 and events[1] == "[DONE]", events
        error = json.loads(events[0])["error"]
        assert error["code"] == "unavailable" and "shutting down" in error["message"], error
        assert worker.process.wait(timeout=30) in (0, -signal.SIGTERM)
        wait_until(lambda: _group_gone(worker.process.pid), "the engine process to exit", 20)
    finally:
        router.stop()
        stop_server(worker)
    for name, path in logs.items():
        assert _log_problems(path) == [], f"the {name} logged:\n{path.read_text()}"
