"""The front end's handle on its engine process: start it, submit, stream, abort, watch health.

Requests go out on a PUSH socket (plain, with a send timeout, so an abort can be sent from any
`finally:` even while a task is being cancelled); outputs come back on an asyncio PULL socket
and a reader task routes them to per-request queues. If the engine dies or stops sending
(no step output or heartbeat for `engine_timeout_s`), every pending request fails at once and
the engine process is started again (at most `max_restarts` times per `restart_window_s`;
after that the worker stays unhealthy for its supervisor to replace). Each engine process gets
fresh sockets, so nothing a dead engine sent is ever read as the new one's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from pdserve.engine.core.config import EngineConfig
from pdserve.engine_process.loop import run_engine_process
from pdserve.protocol.channel import Channel
from pdserve.protocol.codec import ProtocolError
from pdserve.protocol.engine_messages import (
    AbortRequest,
    Bootstrap,
    EngineFailed,
    EngineReady,
    EngineStats,
    FailRoom,
    GenerateRequest,
    Shutdown,
    StepOutputs,
    TokenOutput,
)
from pdserve.protocol.failures import Failure, FailureKind, FailureStage
from pdserve.protocol.restart_budget import RestartBudget
from pdserve.server.role import WorkerRole

logger = logging.getLogger(__name__)

SEND_TIMEOUT_MS = 2000
# What the engine process sends: EngineReady (or EngineFailed) once, then outputs and stats.
FROM_ENGINE = (EngineReady, EngineFailed, EngineStats, StepOutputs)
# Exit codes (negative signal numbers) of an engine that was stopped, not crashed.
STOP_SIGNALS = (-signal.SIGTERM, -signal.SIGINT)


class EngineUnavailable(RuntimeError):
    """The engine process is not running or stopped answering."""


class DuplicateRequestId(ValueError):
    """A request id that is already in flight on this worker."""


@dataclass(frozen=True)
class EngineClientConfig:
    start_timeout_s: float = 900.0
    engine_timeout_s: float = 60.0
    # NOTE: a crash loop (a device gone bad) must not restart forever: past this many
    # restarts within the window, the worker reports itself failed and stays so.
    max_restarts: int = 3
    restart_window_s: float = 300.0


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        role: WorkerRole,
        options: EngineClientConfig | None = None,
    ):
        self.config = config
        self.role = role
        self.options = options or EngineClientConfig()
        # Called with every EngineStats the engine sends (metrics observe its deltas).
        self.stats_listeners: list[Callable[[EngineStats], None]] = []
        self.ready: EngineReady | None = None
        self.stats = EngineStats(0, 0, 0, 0)
        self.failure: str | None = None
        self.gave_up = False
        self._restarts = RestartBudget(self.options.max_restarts, self.options.restart_window_s)
        self._generation = 0
        self._queues: dict[str, asyncio.Queue[TokenOutput]] = {}
        self._last_message = time.monotonic()
        self._scratch = tempfile.TemporaryDirectory(prefix="pdserve-ipc-")
        self._sync_context = zmq.Context()
        self._async_context = zmq.asyncio.Context()
        self._push: Channel | None = None
        self._pull: Channel | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._reader: asyncio.Task | None = None

    # ---- life cycle ------------------------------------------------------------------

    async def start(self) -> EngineReady:
        self.ready = await self._spawn()
        self._reader = asyncio.create_task(self._read_outputs(), name="engine-output-reader")
        return self.ready

    async def _spawn(self) -> EngineReady:
        """Fresh sockets and a fresh engine process; returns once it is ready."""
        self._generation += 1
        requests_addr = f"ipc://{os.path.join(self._scratch.name, f'requests-{self._generation}')}"
        outputs_addr = f"ipc://{os.path.join(self._scratch.name, f'outputs-{self._generation}')}"
        self._push = Channel(self._sync_context, zmq.PUSH, send_timeout_ms=SEND_TIMEOUT_MS)
        self._push.bind(requests_addr)
        self._pull = Channel(self._async_context, zmq.PULL, accepts=FROM_ENGINE)
        self._pull.bind(outputs_addr)
        spawn = multiprocessing.get_context("spawn")
        self._process = spawn.Process(
            target=run_engine_process,
            args=(self.config, requests_addr, outputs_addr, self.role.build_worker),
            name="pdserve-engine",
            daemon=True,
        )
        self._process.start()
        deadline = time.monotonic() + self.options.start_timeout_s
        while True:
            # NOTE: exited is read before the poll: a process that sent its reason and exited
            # has the reason waiting, read below before its exit is reported.
            exited = not self._process.is_alive()
            if await self._pull.socket.poll(timeout=0 if exited else 200):
                msg = (await self._pull.receive_async()).msg
                if isinstance(msg, EngineFailed):
                    raise EngineUnavailable(f"engine failed to start: {msg.reason}")
                if isinstance(msg, EngineReady):
                    self._last_message = time.monotonic()
                    return msg
                continue
            if exited:
                raise EngineUnavailable(
                    f"engine process exited with code {self._process.exitcode} while starting"
                )
            if time.monotonic() > deadline:
                raise EngineUnavailable(
                    f"engine not ready after {self.options.start_timeout_s:.0f} s"
                )

    async def _restart(self) -> None:
        """Replace a failed engine process, unless it failed too often lately."""
        if not self._restarts.take(time.monotonic()):
            self.gave_up = True
            self.failure = (
                f"{self.failure} (after {self.options.max_restarts} restarts within "
                f"{self.options.restart_window_s:.0f} s)"
            )
            logger.error("%s", self.failure)
            return
        logger.warning("restarting the engine after: %s", self.failure)
        await self._stop_process()
        self._close_sockets()
        try:
            self.ready = await self._spawn()
        except Exception as e:
            self.failure = f"engine restart failed: {_one_line(str(e))}"
            logger.error("%s", self.failure)
            return
        self.failure = None
        logger.info("%s worker's engine restarted, ready again", self.role.kind)

    async def _stop_process(self) -> None:
        process = self._process
        if process is None:
            return
        if process.is_alive():
            process.kill()  # NOTE: a failed engine gets no grace: it may be wedged
        await asyncio.to_thread(process.join, 10)

    def _close_sockets(self) -> None:
        for channel in (self._push, self._pull):
            if channel is not None:
                channel.close()

    async def shutdown(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._process is not None and self._process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._push.send(Shutdown("front end stopping"))
            await asyncio.to_thread(self._process.join, 10)
            if self._process.is_alive():
                self._process.kill()
                await asyncio.to_thread(self._process.join, 5)
        self._fail_all("server shutting down")
        self._close_sockets()
        self._sync_context.term()
        self._async_context.term()
        self._scratch.cleanup()

    @property
    def healthy(self) -> bool:
        return (
            self.failure is None
            and self._process is not None
            and self._process.is_alive()
            and time.monotonic() - self._last_message < self.options.engine_timeout_s
        )

    @property
    def health_detail(self) -> str:
        """What /health says: why the engine is not serving, and whether that will pass."""
        if self.healthy:
            return "ok"
        reason = self.failure or "the engine is not answering"
        if self.gave_up:
            return f"engine down, not restarting: {reason}"
        return f"engine restarting after: {reason}"

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def in_flight(self, request_id: str) -> bool:
        """Whether a request with this id is running here (`generate` refuses a second)."""
        return request_id in self._queues

    # ---- requests --------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: dict[str, Any],
        bootstrap: Bootstrap | None = None,
    ) -> AsyncIterator[TokenOutput]:
        """Yield the request's outputs until it finishes. Leaving early (client gone, task
        cancelled) aborts it in the engine, which frees its pages."""
        if not self.healthy:
            raise EngineUnavailable(self.failure or "the engine is not running")
        if request_id in self._queues:
            raise DuplicateRequestId(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            self._send(GenerateRequest(request_id, prompt_token_ids, sampling, bootstrap))
            output = await queue.get()
            while True:
                # NOTE: a stream that fell behind the engine gets what piled up as one output
                # (one SSE event where it would have had several): its per-event work is
                # most of what a front end spends on a token, so it catches up instead of
                # falling further behind. A stream that keeps up still gets every step.
                later = None
                while not output.finished and output.failure is None and not queue.empty():
                    later = queue.get_nowait()
                    if later.failure is not None:
                        break  # NOTE: the tokens before a failure still go out before it
                    output, later = output.followed_by(later), None
                finished = output.finished
                yield output
                if finished:
                    break
                output = later or await queue.get()
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def fail_room(
        self,
        room: int,
        reason: str,
        host: str = "",
        port: int = 0,
        *,
        kind: FailureKind = FailureKind.INVALID,
    ) -> None:
        with contextlib.suppress(EngineUnavailable):
            self._send(FailRoom(room, reason, host, port, kind))

    def abort(self, request_id: str) -> None:
        with contextlib.suppress(EngineUnavailable):
            self._send(AbortRequest(request_id))

    def cancel(self, request_id: str, reason: str) -> bool:
        """End a request in flight from outside its stream: abort it in the engine and end
        its stream with `reason`. False if no such request is in flight."""
        queue = self._queues.get(request_id)
        if queue is None:
            return False
        # NOTE: the reason goes first: an abort that finds the engine gone fails the
        # request's queue with the engine's reason, which is not why this request ended.
        queue.put_nowait(_failed(request_id, reason))
        self.abort(request_id)
        return True

    def cancel_all(self, reason: str) -> None:
        """End every request in flight (`cancel`), e.g. at the shutdown timeout: each
        stream gets its error event and its end, and the engine frees their pages."""
        request_ids = list(self._queues)
        for request_id in request_ids:
            self._queues[request_id].put_nowait(_failed(request_id, reason))
        # NOTE: an engine stopped with the worker's process group (SIGTERM to the group) is
        # noticed before the aborts, so none waits out the send timeout for a reader that
        # is gone.
        self._check_alive()
        for request_id in request_ids:
            self.abort(request_id)

    def _send(self, msg) -> None:
        if self.failure is not None:
            # NOTE: a failed (or restarting) engine holds none of our requests any more.
            raise EngineUnavailable(self.failure)
        try:
            self._push.send(msg)
        except zmq.Again:
            self._mark_failed("engine not accepting requests (send timed out)")
            raise EngineUnavailable(self.failure) from None

    # ---- outputs ---------------------------------------------------------------------

    async def _read_outputs(self) -> None:
        while not self.gave_up:
            if self.failure is not None:
                await self._restart()
                continue
            if not await self._pull.socket.poll(timeout=1000):
                self._check_alive()
                continue
            self._last_message = time.monotonic()
            try:
                msg = (await self._pull.receive_async()).msg
            except ProtocolError as e:
                logger.error("dropped a malformed message from the engine: %s", e)
                continue
            if isinstance(msg, EngineFailed):
                self._mark_failed(f"engine failed: {_one_line(msg.reason)}")
            elif isinstance(msg, EngineStats):
                self._set_stats(msg)
            elif isinstance(msg, StepOutputs):  # NOTE: EngineReady comes once, read by _spawn
                self._set_stats(msg.stats)
                for output in msg.outputs:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)

    def _set_stats(self, stats: EngineStats) -> None:
        self.stats = stats
        for listener in self.stats_listeners:
            try:
                listener(stats)
            except Exception:
                # NOTE: a broken counter must not stop this reader: every request's outputs
                # come through it, right after these stats.
                logger.exception("a stats listener failed (outputs are still delivered)")

    def _check_alive(self) -> None:
        if self._process is not None and not self._process.is_alive():
            code = self._process.exitcode
            if code in STOP_SIGNALS:
                # NOTE: someone stopped it on purpose (the worker's process group is being
                # stopped, or Ctrl-C): restarting would fight them.
                self.gave_up = True
                reason = f"engine process stopped by {signal.Signals(-code).name}"
                self._mark_failed(reason, level=logging.WARNING)
            else:
                self._mark_failed(f"engine process exited with code {code}")
        elif time.monotonic() - self._last_message > self.options.engine_timeout_s:
            self._mark_failed(f"engine silent for over {self.options.engine_timeout_s:.0f} s")

    def _mark_failed(self, reason: str, level: int = logging.ERROR) -> None:
        if self.failure is None:
            logger.log(level, "%s", reason)
            self.failure = reason
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(_failed(request_id, reason))


def _failed(request_id: str, reason: str) -> TokenOutput:
    """The last output of a request that ended outside the engine (it is worth a retry)."""
    failure = Failure(FailureKind.UNAVAILABLE, FailureStage.ENGINE, reason)
    return TokenOutput.failed(request_id, failure)


def _one_line(reason: str, limit: int = 200) -> str:
    """An engine's failure as clients may see it: its first line, bounded."""
    lines = reason.strip().splitlines()
    line = lines[0] if lines else "unknown error"
    return line if len(line) <= limit else line[: limit - 3] + "..."
