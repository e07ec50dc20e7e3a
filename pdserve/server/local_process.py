"""Start a `pdserve` role as a child process on this machine, wait until it is healthy, stop
it with everything it started. Used by tests, benchmarks and `pdserve launch`."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx


class ServerStartError(RuntimeError):
    """The process exited or stayed unhealthy past its deadline."""


# Ports this process handed out: never handed out twice, even before anything binds them.
_handed_out: set[int] = set()
# How far below the kernel's ephemeral range free ports are drawn from.
PORT_SPAN = 12_000


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, drawn at random from below the kernel's ephemeral range.

    NOTE: a port the kernel picks (bind to 0) lies in the ephemeral range, which is also where
    outgoing connections take their local ports: between this call and the server's bind, any
    connection on the machine could take it ("address already in use"). Below that range
    only another server can."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - PORT_SPAN), low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # the whole span is busy: fall back on the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def child_python() -> list[str]:
    """The interpreter command a child `python -m pdserve...` starts with.

    NOTE: `-m` puts the current directory first on sys.path, where a `pdserve/` directory (a
    clone's parent, or a checkout without an install) would shadow the installed package;
    `-P` (Python 3.11+) leaves it out. PYTHONPATH still applies. The child's own children
    inherit the flag (multiprocessing's spawn passes the interpreter's flags on)."""
    return [sys.executable, "-P"]


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
        log_path: str | None = None,
        echo: Callable[[str], None] | None = None,
    ):
        """env: extra environment for the child. The child exits by itself if this process
        dies (see `pdserve.launch.watch_parent`). log_path: the child's output (stdout and
        stderr) is appended there, each line also handed to `echo`; without it the child
        writes to this process's stdout and stderr."""
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        command = [
            *child_python(),
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
        self._command = command
        self._env = {**os.environ, **(env or {}), "PDSERVE_EXIT_WITH_PARENT": str(os.getpid())}
        self.log_path = log_path
        self._echo = echo
        self.process = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        if self.log_path is None:
            return subprocess.Popen(self._command, start_new_session=True, env=self._env)
        process = subprocess.Popen(
            self._command,
            start_new_session=True,
            env=self._env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        self._copier = threading.Thread(
            target=self._copy_output, args=(process,), name="child-log", daemon=True
        )
        self._copier.start()
        return process

    def _copy_output(self, process: subprocess.Popen) -> None:
        with open(self.log_path, "a") as log:
            for line in process.stdout:
                log.write(line)
                log.flush()
                if self._echo is not None:
                    self._echo(line)
        process.stdout.close()

    def failure_cause(self) -> str:
        """The child's last error line (else its last line) from its log, and where the log
        is; empty without a log."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, errors="replace") as log:
                lines = [line.strip() for line in log.readlines()[-200:] if line.strip()]
        except OSError:
            return f" (log: {self.log_path})"
        errors = [line for line in lines if line.lower().startswith(("error", "critical"))]
        cause = (errors or lines or [""])[-1].removeprefix("error: ")
        return f": {cause} (full log: {self.log_path})" if cause else f" (log: {self.log_path})"

    def restart(self, cleanup_deadline_s: float = 10.0) -> None:
        """Start the same command again, on the same ports, after the process exited (what a
        container restart does: same address, fresh process)."""
        self.stop()
        # NOTE: what the old process started (its engine process holds the bootstrap port) is
        # killed and gone before the new one binds the same ports.
        _kill_group(self.process.pid, cleanup_deadline_s)
        self.process = self._spawn()

    def wait_healthy(self, deadline_s: float, poll_s: float = 0.1) -> LocalServer:
        deadline = time.monotonic() + deadline_s
        while True:
            if self.process.poll() is not None:
                if self.log_path is not None:
                    # NOTE: its last lines may still be on their way to the log (EOF comes
                    # once its engine process, which shares the pipe, is gone too).
                    self._copier.join(timeout=2.0)
                raise ServerStartError(
                    f"exited with code {self.process.returncode} on start{self.failure_cause()}"
                )
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


def engine_pid_of(server_pid: int) -> int:
    """The pid of a worker's engine process: the child its front end (`server_pid`) started
    with multiprocessing's spawn. Linux (/proc)."""
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
        children = [int(pid) for pid in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return pid
    raise LookupError(f"no engine process among {children}, the children of {server_pid}")


def _kill_group(pgid: int, deadline_s: float) -> None:
    """SIGKILL every process left in group `pgid` and wait until none is."""
    deadline = time.monotonic() + deadline_s
    try:
        os.killpg(pgid, signal.SIGKILL)
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)  # raises once the group is empty
            time.sleep(0.05)
    except ProcessLookupError:
        return
    raise ServerStartError(f"processes of group {pgid} still alive after {deadline_s:.0f} s")
