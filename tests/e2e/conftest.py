"""Real `pdserve serve` processes on loopback, started once per module and always stopped."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdserve.server.local_process import LocalServer, engine_pid_of

START_DEADLINE_S = 120.0


@dataclass
class Server:
    """A running `pdserve serve` and small helpers to talk to it."""

    local: LocalServer
    model_path: str

    @property
    def url(self) -> str:
        return self.local.url

    @property
    def process(self):
        return self.local.process

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, body=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60, **kw)

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").text.splitlines():
            if line.startswith((f"pdserve:{name}{{", f"pdserve:{name} ")):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


def engine_pid(server: Server) -> int:
    """The pid of a worker's engine process (its spawned child)."""
    return engine_pid_of(server.process.pid)


def rank_pids(worker_pid: int) -> list[int]:
    """The tensor-parallel rank processes below a worker (its engine process's children)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            parents[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmdline)

    def below(pid: int) -> bool:
        while pid > 1 and pid in parents:
            pid = parents[pid][0]
            if pid == worker_pid:
                return True
        return False

    return [p for p, (_, cmd) in parents.items() if b"rank_worker" in cmd and below(p)]


def start_server(model_path: str, *extra: str) -> Server:
    local = LocalServer(["serve", "--model-path", model_path, "--device", "cpu", *extra])
    return Server(local.wait_healthy(START_DEADLINE_S), model_path)


def stop_server(server: Server) -> None:
    server.local.stop()


@pytest.fixture(scope="session")
def server(tiny_model_dirs):
    running = start_server(tiny_model_dirs("llama"), "--max-model-len", "512")
    yield running
    stop_server(running)
