"""The engine process: `Engine.step()` in a loop, fed and drained over ZMQ by the front end.

It is a separate process so HTTP parsing, tokenization and streaming never take time from the
step loop. The loop is the same for every worker: the engine, built in this process by the
factory the command line chose (a prefill or decode worker's with its `KVConnector`). Each
turn (`EngineLoop.tick`) handles the messages that came in, applies what the transfers did
(`Engine.poll_transfers`) and steps; `EngineLoop.run` only moves messages between ZMQ and
`tick`. A turn that produced something sends one `StepOutputs` message; while
idle the loop sends `EngineStats` every `HEARTBEAT_S` so the front end can tell a live engine
from a hung one. A message the engine cannot decode is logged and dropped; it never stops the
loop.

A step that raises fails the requests of its batch (their pages are freed), not the engine:
the traceback goes to this process's log, each request gets a one-line error. Only
`MAX_CONSECUTIVE_FAILURES` failed steps in a row (a broken device, not a bad request) end the
process, which the front end then restarts. Tracebacks never travel to the front end.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import get_args

import zmq

from pdserve.engine.core.config import EngineConfig
from pdserve.engine.core.errors import InvalidRequestError
from pdserve.engine.core.outputs import RequestOutput
from pdserve.engine.core.request import RequestStatus
from pdserve.engine.core.sampling_params import InvalidSamplingParams, SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.kv_connector import WorkerFactory
from pdserve.engine.ranks.rank_group import RankDiedError
from pdserve.engine_process.hold_point import HoldPoint
from pdserve.engine_process.stream_interval import StreamInterval
from pdserve.protocol.channel import Channel
from pdserve.protocol.codec import ProtocolError
from pdserve.protocol.engine_messages import (
    AbortRequest,
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

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
# While rooms are in flight and the engine idles: how often the loop looks at them anyway (the
# doorbell wakes it for every change; this is for the handoff's own queue deadlines).
HANDOFF_POLL_MS = 10
SEND_TIMEOUT_MS = 5000
MAX_CONSECUTIVE_FAILURES = 3

# What the front end sends the engine process.
Message = GenerateRequest | AbortRequest | FailRoom | Shutdown


def run_engine_process(
    config: EngineConfig, requests_addr: str, outputs_addr: str, build_worker: WorkerFactory
) -> None:
    """Process entry point: build the worker (its engine and connector), announce it, serve
    until told to shut down."""
    level = os.environ.get("PDSERVE_LOG_LEVEL", "info").upper()
    logging.basicConfig(level=level, format="%(levelname)s engine: %(message)s")
    # NOTE: the front end owns this process's life: it says `Shutdown` once its requests
    # ended (or its shutdown timeout passed), SIGKILLs a wedged engine, and the loop stops by
    # itself if the front end is gone. A stop signal sent to the worker's whole process group
    # (systemd's default, `kill -TERM -PGID`, Ctrl-C) reaches the front end too; acted on here,
    # it would end every stream at once instead of after the front end's grace period.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    context = zmq.Context()
    inbox = Channel(context, zmq.PULL, accepts=get_args(Message))
    inbox.connect(requests_addr)
    outbox = Channel(context, zmq.PUSH, send_timeout_ms=SEND_TIMEOUT_MS)
    outbox.connect(outputs_addr)
    try:
        engine = build_worker(config)
    except Exception as e:
        # NOTE: the front end reports the one line; the traceback is for --log-level debug.
        logger.debug("engine failed to start", exc_info=True)
        outbox.send(EngineFailed(short_reason(e)))
        # NOTE: the reason is still queued: without a linger, closing drops it and the
        # front end only learns that the process exited.
        outbox.close(linger_ms=SEND_TIMEOUT_MS)
        inbox.close()
        context.term()
        sys.exit(1)
    outbox.send(_ready(engine))
    if engine.ranks is not None:
        engine.ranks.watch(_exit_stuck)
    try:
        EngineLoop(engine).run(inbox, outbox)
    except Exception as e:
        # NOTE: the traceback is logged here (raise); the front end gets one line.
        outbox.send(EngineFailed(short_reason(e)))
        raise
    finally:
        if engine.connector is not None:
            engine.connector.stop()
        engine.close()
        inbox.close()
        outbox.close()
        context.term()


def _exit_stuck(reason: str) -> None:
    """A tensor-parallel rank died and this process's loop is blocked past it (waiting for
    the dead rank on the GPU): end the process, as its own death would. The front end fails
    its requests and starts a new engine; the other ranks leave when this one is gone."""
    logger.error("%s; ending the engine process", reason)
    os._exit(1)


def _ready(engine: Engine) -> EngineReady:
    connector = engine.connector
    return EngineReady(
        model_path=engine.config.model_path,
        architecture=engine.model_config.architecture,
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        kv_pages_total=engine.kv_pool.num_pages,
        page_size=engine.config.page_size,
        device=str(engine.device),
        dtype=str(engine.dtype).removeprefix("torch."),
        role=engine.role,
        bootstrap_port=connector.bootstrap_port if connector is not None else None,
    )


class EngineLoop:
    """Handle messages, apply what the transfers did, step, hand the outputs over."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.running = True
        self.num_steps = 0
        self.step_seconds = 0.0
        self.batched_tokens = 0
        self.consecutive_failures = 0
        self.stream_interval = StreamInterval(self.engine.config.stream_interval)
        self.hold = HoldPoint.from_env()  # NOTE: tests only (engine_process/hold_point.py)

    def tick(self, messages: list[Message]) -> StepOutputs | None:
        """One turn: the messages, the transfers' progress, a step if there is work. Returns
        what to send the front end (None: nothing happened). Raises once
        `MAX_CONSECUTIVE_FAILURES` steps or transfer polls failed in a row."""
        outputs: list[TokenOutput] = []
        for msg in messages:
            outputs.extend(self._handle(msg))
        produced = self._guarded(self.engine.poll_transfers)
        stepped = self.engine.has_unfinished()
        if stepped:
            produced.extend(self._step())
            if self.hold is not None:
                self.hold.after_step(self.engine.requests.values())
        outputs.extend(_to_wire(o) for o in produced)
        outputs = self.stream_interval.pass_on(outputs, live=self.engine.requests)
        if logger.isEnabledFor(logging.DEBUG):
            _log_ends(outputs)
        if not (stepped or outputs):
            return None
        return StepOutputs(outputs, self._stats())

    def run(self, inbox: Channel, outbox: Channel) -> None:
        """Receive from the front end, tick, send, until shut down (or the front end is
        gone); heartbeats while idle."""
        poller = zmq.Poller()
        poller.register(inbox.socket, zmq.POLLIN)
        doorbell = self.engine.connector.doorbell if self.engine.connector else None
        if doorbell is not None:
            poller.register(doorbell.fileno(), zmq.POLLIN)
        parent_pid = os.getppid()
        last_sent = 0.0
        while self.running:
            if os.getppid() != parent_pid:
                # NOTE: the front end died without saying so (SIGKILL): nobody reads our
                # outputs any more, so stop instead of computing for no one.
                logger.error("front end process is gone; shutting the engine down")
                return
            result = self.tick(_receive(poller, inbox, self.idle_wait_ms(), doorbell))
            if result is None and time.monotonic() - last_sent >= HEARTBEAT_S:
                result = self._stats()
            if result is not None:
                self._send(outbox, result)
                last_sent = time.monotonic()

    def _step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            if isinstance(e, RankDiedError):
                # NOTE: a tensor-parallel worker short of a rank can never step again: end
                # the process now (the front end fails its requests and starts a fresh one).
                self.consecutive_failures = MAX_CONSECUTIVE_FAILURES - 1
            self._count_failure()
            logger.exception("engine step failed; failing the requests of its batch")
            outputs = self.engine.fail_step(
                f"the engine failed while running this request: {short_reason(e)}"
            )
        else:
            self.consecutive_failures = 0
        self.step_seconds += time.perf_counter() - started
        self.num_steps += 1
        self.batched_tokens += self.engine.last_batch_tokens
        return outputs

    def _guarded(self, work) -> list[RequestOutput]:
        """Transfer bookkeeping: a failure is logged and counted like a failed step."""
        try:
            return work()
        except Exception:
            self._count_failure()
            logger.exception("the disaggregated transfers' poll failed")
            return []

    def _count_failure(self) -> None:
        self.consecutive_failures += 1
        if self.consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
            # NOTE: step after step failing is the engine's state, not one request: end the
            # process (the exception propagates) so the front end starts a fresh one.
            logger.error("%d consecutive failures; stopping the engine", self.consecutive_failures)
            raise

    def idle_wait_ms(self) -> int:
        """How long to wait for requests: not at all while the engine has work, briefly while
        rooms are in flight (the connector's doorbell ends the wait at each room's change; this
        bounds it for the queues' deadlines), else until the next heartbeat."""
        if self.engine.has_unfinished():
            return 0
        if self.engine.has_transfers:
            return HANDOFF_POLL_MS
        return int(HEARTBEAT_S * 1000)

    def _handle(self, msg: Message) -> list[TokenOutput]:
        """Act on one message; returns the outputs of requests it refused."""
        if isinstance(msg, Shutdown):
            self.running = False
        elif isinstance(msg, FailRoom):
            if self.engine.connector is not None:
                self.engine.connector.fail_room(msg)
        elif isinstance(msg, AbortRequest):
            self.engine.abort_request(msg.request_id)
            self.stream_interval.drop(msg.request_id)
        else:
            return self._add(msg)
        return []

    def _add(self, msg: GenerateRequest) -> list[TokenOutput]:
        try:
            params = SamplingParams(**msg.sampling)
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, params, msg.bootstrap)
            room = f", room {msg.bootstrap.room}" if msg.bootstrap is not None else ""
            logger.debug(
                "request %s: added, %d prompt tokens%s",
                msg.request_id,
                len(msg.prompt_token_ids),
                room,
            )
            return []
        except (InvalidRequestError, InvalidSamplingParams, TypeError) as e:
            return [_failed(msg, Failure(FailureKind.INVALID, FailureStage.ENGINE, str(e)))]
        except Exception as e:
            logger.exception("could not add request %s", msg.request_id)
            reason = f"the engine could not take this request: {short_reason(e)}"
            return [_failed(msg, Failure(FailureKind.INTERNAL, FailureStage.ENGINE, reason))]

    def _stats(self) -> EngineStats:
        engine = self.engine
        cache = engine.prefix_cache
        return EngineStats(
            num_running=engine.count(RequestStatus.RUNNING),
            num_waiting=engine.count(RequestStatus.WAITING),
            kv_pages_used=self.engine.kv_pages_in_use,
            kv_pages_total=self.engine.allocator.num_pages,
            num_steps=self.num_steps,
            step_seconds=self.step_seconds,
            batched_tokens=self.batched_tokens,
            kv_pages_cached=cache.num_pages if cache else 0,
            prefix_cache_evictions=cache.num_evicted if cache else 0,
            disagg=engine.connector.stats() if engine.connector is not None else None,
        )

    def _send(self, outbox: Channel, msg: StepOutputs | EngineStats) -> None:
        try:
            outbox.send(msg)
        except zmq.Again:
            # The front end stopped reading for SEND_TIMEOUT_MS: it is gone or wedged.
            logger.error("front end not receiving; shutting the engine down")
            self.running = False


def _log_ends(outputs: list[TokenOutput]) -> None:
    """A debug line for each request that ended, named by its id (one grep finds its life)."""
    for output in outputs:
        if output.finished:
            end = output.finish_reason if output.failure is None else output.failure.label
            logger.debug(
                "request %s: ended (%s), %d prompt + %d output tokens",
                output.request_id,
                end,
                output.num_prompt_tokens,
                output.num_output_tokens,
            )


def _receive(poller: zmq.Poller, inbox: Channel, timeout_ms: int, doorbell=None) -> list[Message]:
    """What came in within `timeout_ms` (then all that is queued), decoded; returns early,
    maybe with nothing, when the handoff's `doorbell` rings (a room moved)."""
    messages = []
    while events := dict(poller.poll(timeout_ms)):
        timeout_ms = 0
        if doorbell is not None and doorbell.fileno() in events:
            doorbell.answer()
        if inbox.socket not in events:
            continue
        try:
            messages.append(inbox.receive().msg)
        except ProtocolError as e:
            logger.warning("dropped a malformed message: %s", e)
    return messages


def short_reason(error: BaseException, limit: int = 200) -> str:
    """One line naming an exception, for clients: never a traceback, never a huge message."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _failed(msg: GenerateRequest, failure: Failure) -> TokenOutput:
    return TokenOutput.failed(msg.request_id, failure, len(msg.prompt_token_ids))


def _to_wire(output: RequestOutput) -> TokenOutput:
    top = None
    if output.new_top_logprobs is not None:
        top = [[[t, lp] for t, lp in entry.items()] for entry in output.new_top_logprobs]
    return TokenOutput(
        request_id=output.request_id,
        new_token_ids=output.new_token_ids,
        finished=output.finished,
        num_prompt_tokens=len(output.prompt_token_ids),
        num_output_tokens=len(output.token_ids),
        finish_reason=output.finish_reason,
        stop_reason=output.stop_reason,
        failure=output.failure,
        new_logprobs=output.new_logprobs,
        new_top_logprobs=top,
        spec_verify_ct=output.spec_verify_ct,
        spec_emitted_tokens=output.spec_emitted_tokens,
        num_cached_tokens=output.num_cached_tokens,
    )
