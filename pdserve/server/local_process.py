"""Start a `pdserve` role as a child process on this machine, wait until it is healthy, stop
it with everything it started. Used by tests, benchmarks and `pdserve launch`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


class ServerStartError(RuntimeError):
    """The process exited or stayed unhealthy past its deadline."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalServer:
    """`pdserve <role> ... --port PORT` in its own process group."""

    def __init__(
        self,
        role_args: list[str],
        *,
        port: int | None = None,
        log_level: str = "warning",
        host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
    ):
        """env: extra environment for the child. The child exits by itself if this process
        dies (see `pdserve.launch.watch_parent`)."""
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        command = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "--log-level",
            log_level,
            *role_args,
            "--host",
            host,
            "--port",
            str(self.port),
        ]
        child_env = {**os.environ, **(env or {}), "PDSERVE_EXIT_WITH_PARENT": str(os.getpid())}
        self.process = subprocess.Popen(command, start_new_session=True, env=child_env)

    def wait_healthy(self, deadline_s: float, poll_s: float = 0.1) -> LocalServer:
        deadline = time.monotonic() + deadline_s
        while True:
            if self.process.poll() is not None:
                raise ServerStartError(f"exited with code {self.process.returncode} on start")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"not healthy after {deadline_s:.0f} s")
            time.sleep(poll_s)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the process group (server and engine), SIGKILL what is left after."""
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
