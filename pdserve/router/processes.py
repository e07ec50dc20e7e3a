"""Several router processes serving one port (`--router-processes N`).

One router process relays every stream on one core (~50 µs of CPU a relayed chunk,
`benchmarks/RESULTS.md`); under many concurrent streams that core is the limit. With N
processes each relays the streams of the connections it accepted: the parent binds N
listening sockets to the port with SO_REUSEPORT (the kernel spreads new connections over
them) and forks one router process a socket. Each process routes on its own: its own round
robin turns, health checks, in-flight counts and leg connections (hence the limits in
`RouterConfig`); their Prometheus metrics are summed across processes (`RouterMetrics`).

The parent only supervises. It keeps every socket open, so a process that dies loses no
connection waiting in its socket's queue: a new process takes the socket over (at most
`RESTARTS_PER_MINUTE` restarts a minute; past that, or a process that fails while starting,
every process stops and the router exits 1). SIGTERM or SIGINT stops them all, each within
its graceful shutdown; any still running `KILL_AFTER_S` later is killed. A process whose
parent is gone (killed) stops by itself. Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

from pdserve.protocol.restart_budget import RestartBudget

logger = logging.getLogger(__name__)

RESTARTS_PER_MINUTE = 5
# A process that exits with an error (not killed) this soon after it started failed to start.
START_GRACE_S = 10.0
KILL_AFTER_S = 5.0  # beyond the graceful shutdown
POLL_S = 0.1  # how often the parent looks for ended processes
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening sockets on one port (port 0: the first one's)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            sock.listen(2048)
            sock.set_inheritable(True)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Supervisor:
    """Runs `serve(sock)` in a forked process per socket, until told to stop."""

    def __init__(
        self,
        sockets: list[socket.socket],
        serve: Callable[[socket.socket], int],
        shutdown_timeout_s: float,
        on_exit: Callable[[int], None] = lambda pid: None,
    ):
        """`serve`: runs in the child, returns its exit code. `on_exit(pid)`: a process
        ended (its metrics are marked dead)."""
        self.sockets = sockets
        self.serve = serve
        self.kill_after_s = shutdown_timeout_s + KILL_AFTER_S
        self.on_exit = on_exit
        self.running: dict[int, tuple[int, float]] = {}  # pid -> (socket index, start time)
        self.restarts = RestartBudget(RESTARTS_PER_MINUTE, 60.0)
        self.stop_signal: int | None = None

    def run(self) -> int:
        """Start every process and supervise them; the exit code (0 after a signal)."""
        # NOTE: handlers, not blocked signals: the main thread runs them whichever thread
        # the signal reaches (the CLI may have started one, `watch_parent`).
        previous = {signo: signal.signal(signo, self._stop_on) for signo in _STOP_SIGNALS}
        try:
            for index in range(len(self.sockets)):
                self._start(index)
            code = self._supervise()
        finally:
            self._stop()
            for signo, handler in previous.items():
                signal.signal(signo, handler)
        return code

    def _stop_on(self, signo, frame) -> None:
        self.stop_signal = signo

    def _supervise(self) -> int:
        while self.stop_signal is None:
            for pid, status in self._reap():
                index, started = self.running.pop(pid)
                code = os.waitstatus_to_exitcode(status)
                self.on_exit(pid)
                if code > 0 and time.monotonic() - started < START_GRACE_S:
                    logger.error("router process %d failed to start (exit %d)", pid, code)
                    return 1
                if not self.restarts.take(time.monotonic()):
                    logger.error(
                        "router process %d exited (%d); %d restarts in the last minute: stopping",
                        pid,
                        code,
                        RESTARTS_PER_MINUTE,
                    )
                    return 1
                logger.warning("router process %d exited (%d); starting another", pid, code)
                self._start(index)
            time.sleep(POLL_S)
        logger.info("router stopping (%s)", signal.Signals(self.stop_signal).name)
        return 0

    def _start(self, index: int) -> None:
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # NOTE: the child never returns into the parent's code
            code = 1
            try:
                for signo in _STOP_SIGNALS:
                    signal.signal(signo, signal.SIG_DFL)
                for other, sock in enumerate(self.sockets):
                    if other != index:
                        sock.close()
                _stop_with_parent(parent)
                code = self.serve(self.sockets[index])
            except BaseException:
                logger.exception("router process failed")
            finally:
                os._exit(code)
        self.running[pid] = (index, time.monotonic())

    def _reap(self) -> list[tuple[int, int]]:
        ended = []
        while self.running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # NOTE: none left
                break
            if pid == 0:
                break
            if pid in self.running:
                ended.append((pid, status))
        return ended

    def _stop(self) -> None:
        """SIGTERM every process; SIGKILL those still running past the deadline."""
        # NOTE: first, so that each socket closes with its process's copy (as a lone
        # router's closes at shutdown): new connections are refused, not left queued.
        for sock in self.sockets:
            sock.close()
        for pid in self.running:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_after_s
        while self.running and time.monotonic() < deadline:
            for pid, _ in self._reap():
                self.running.pop(pid)
                self.on_exit(pid)
            if self.running:
                time.sleep(POLL_S)
        for pid in self.running:
            logger.error("router process %d did not stop in time: killed", pid)
            _signal(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            self.on_exit(pid)
        self.running.clear()


def _stop_with_parent(parent: int) -> None:
    """SIGTERM this process when `parent` dies (Linux: the kernel sends it)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # NOTE: it died before the call
        os.kill(os.getpid(), signal.SIGTERM)


def _signal(pid: int, signo: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # NOTE: ended meanwhile; reaped below
        os.kill(pid, signo)
