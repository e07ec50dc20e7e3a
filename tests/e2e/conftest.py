"""Real `pdserve serve` processes on loopback, started once per module and always stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest

START_DEADLINE_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    model_path: str

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, body=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60, **kw)

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(f"pdserve:{name}{{") or line.startswith(f"pdserve:{name} "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def wait_for(self, predicate, what: str, deadline_s: float = 20.0) -> None:
        deadline = time.monotonic() + deadline_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")
            time.sleep(0.05)


def start_server(model_path: str, *extra: str) -> Server:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "--log-level",
        "warning",
        "serve",
        "--model-path",
        model_path,
        "--port",
        str(port),
        "--device",
        "cpu",
        *extra,
    ]
    process = subprocess.Popen(command, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", process, model_path)
    deadline = time.monotonic() + START_DEADLINE_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} while starting")
        try:
            if server.get("/health").status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"server not healthy after {START_DEADLINE_S} s")
        time.sleep(0.1)


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGTERM)
        try:
            server.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=10)


@pytest.fixture(scope="session")
def server(tiny_model_dirs):
    running = start_server(tiny_model_dirs("llama"), "--max-model-len", "512")
    yield running
    stop_server(running)
