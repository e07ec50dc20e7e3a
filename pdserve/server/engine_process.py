"""The engine process: `Engine.step()` in a loop, fed and drained over ZMQ by the front end.

It is a separate process so HTTP parsing, tokenization and streaming never take time from the
step loop. Each step sends one `StepOutputs` message; while idle it sends `EngineStats` every
`HEARTBEAT_S` so the front end can tell a live engine from a hung one. A message the engine
cannot decode is logged and dropped; it never stops the loop.
"""

from __future__ import annotations

import logging
import os
import time
import traceback

import zmq

from pdserve.engine.config import EngineConfig
from pdserve.engine.outputs import RequestOutput
from pdserve.protocol.codec import ProtocolError, decode, encode
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
from pdserve.server.role import WorkerRole

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
HANDOFF_POLL_MS = 1
SEND_TIMEOUT_MS = 5000


def run_engine_process(
    config: EngineConfig, requests_addr: str, outputs_addr: str, role: WorkerRole | None = None
) -> None:
    """Process entry point: build the engine (and the role's handoff), announce it, serve
    until told to shut down."""
    role = role or WorkerRole()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s engine: %(message)s")
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(requests_addr)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    outbox.setsockopt(zmq.LINGER, 0)
    outbox.connect(outputs_addr)
    try:
        from pdserve.speculative.engine import build_engine

        engine = build_engine(config)
        handoff = _build_handoff(engine, role)
    except Exception as e:
        outbox.send(encode(EngineFailed(f"{type(e).__name__}: {e}")))
        raise
    outbox.send(encode(_ready(engine, role, handoff)))
    try:
        EngineLoop(engine, inbox, outbox, handoff).run()
    except Exception:
        outbox.send(encode(EngineFailed(traceback.format_exc())))
        raise
    finally:
        if handoff is not None:
            handoff.stop()
        inbox.close(0)
        outbox.close(0)
        context.term()


def _build_handoff(engine, role: WorkerRole):
    """The role's handoff: its queues and transfer endpoint (None when colocated)."""
    if role.kind == "prefill":
        from pdserve.prefill.handoff import PrefillHandoff

        return PrefillHandoff(engine, role.transfer)
    if role.kind == "decode":
        from pdserve.decode.handoff import DecodeHandoff

        return DecodeHandoff(engine, role.transfer)
    return None


def _ready(engine, role: WorkerRole, handoff) -> EngineReady:
    return EngineReady(
        model_path=engine.config.model_path,
        architecture=engine.model_config.architecture,
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        kv_pages_total=engine.kv_pool.num_pages,
        page_size=engine.config.page_size,
        device=str(engine.device),
        dtype=str(engine.dtype).removeprefix("torch."),
        role=role.kind,
        bootstrap_port=handoff.bootstrap_port if handoff is not None else None,
    )


class EngineLoop:
    """Receive, move the handoff along (disaggregated roles), step, report."""

    def __init__(self, engine, inbox: zmq.Socket, outbox: zmq.Socket, handoff=None):
        self.engine = engine
        self.handoff = handoff
        self.inbox = inbox
        self.outbox = outbox
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self.running = True
        self.last_sent = 0.0
        self.parent_pid = os.getppid()
        self.num_steps = 0
        self.step_seconds = 0.0
        self.batched_tokens = 0

    def run(self) -> None:
        while self.running:
            if os.getppid() != self.parent_pid:
                # NOTE: the front end died without saying so (SIGKILL): nobody reads our
                # outputs any more, so stop instead of computing for no one.
                logger.error("front end process is gone; shutting the engine down")
                return
            self._receive(timeout_ms=self._idle_wait_ms())
            outputs = self.handoff.poll() if self.handoff is not None else []
            stepped = self.engine.has_unfinished()
            if stepped:
                started = time.perf_counter()
                step_outputs = self.engine.step()
                self.step_seconds += time.perf_counter() - started
                self.num_steps += 1
                self.batched_tokens += self.engine.last_batch_tokens
                if self.handoff is not None:
                    step_outputs = self.handoff.on_step(step_outputs)
                outputs.extend(step_outputs)
            if stepped or outputs:
                self._send(StepOutputs([_to_wire(o) for o in outputs], self._stats()))
            elif time.monotonic() - self.last_sent >= HEARTBEAT_S:
                self._send(self._stats())

    def _idle_wait_ms(self) -> int:
        """How long to wait for requests: not at all while the engine has work, briefly while
        rooms are in flight (their progress is polled), else until the next heartbeat."""
        if self.engine.has_unfinished():
            return 0
        if self.handoff is not None and self.handoff.busy:
            return HANDOFF_POLL_MS
        return int(HEARTBEAT_S * 1000)

    def _receive(self, timeout_ms: int) -> None:
        while self.poller.poll(timeout_ms):
            timeout_ms = 0
            data = self.inbox.recv()
            try:
                msg = decode(data, (GenerateRequest, AbortRequest, FailRoom, Shutdown))
            except ProtocolError as e:
                logger.warning("dropped a malformed message: %s", e)
                continue
            self._handle(msg)

    def _handle(self, msg) -> None:
        if isinstance(msg, Shutdown):
            self.running = False
        elif isinstance(msg, FailRoom):
            if self.handoff is not None:
                self.handoff.fail_room(msg)
        elif isinstance(msg, AbortRequest):
            if self.handoff is None or not self.handoff.abort(msg.request_id):
                self.engine.abort_request(msg.request_id)
        else:
            self._add(msg)

    def _add(self, msg: GenerateRequest) -> None:
        from pdserve.engine.errors import InvalidRequestError
        from pdserve.engine.sampling_params import InvalidSamplingParams, SamplingParams

        try:
            params = SamplingParams(**msg.sampling)
            if (self.handoff is None) != (msg.bootstrap is None):
                raise InvalidRequestError(_role_mismatch(self.handoff is not None))
            if self.handoff is None:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, params)
                return
            refused = self.handoff.add(msg.request_id, msg.prompt_token_ids, params, msg.bootstrap)
            if refused is not None:
                self._send(StepOutputs([_to_wire(refused)], self._stats()))
        except (InvalidRequestError, InvalidSamplingParams, TypeError) as e:
            self._send(StepOutputs([_failed(msg, str(e))], self._stats()))

    def _stats(self) -> EngineStats:
        scheduler = self.engine.scheduler
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_pages_used=self.engine.allocator.num_used,
            kv_pages_total=self.engine.allocator.num_pages,
            num_steps=self.num_steps,
            step_seconds=self.step_seconds,
            batched_tokens=self.batched_tokens,
            disagg=self.handoff.stats() if self.handoff is not None else None,
        )

    def _send(self, msg) -> None:
        try:
            self.outbox.send(encode(msg))
        except zmq.Again:
            # The front end stopped reading for SEND_TIMEOUT_MS: it is gone or wedged.
            logger.error("front end not receiving; shutting the engine down")
            self.running = False
        self.last_sent = time.monotonic()


def _role_mismatch(disaggregated: bool) -> str:
    if disaggregated:
        return (
            "this is a disaggregated worker: requests need bootstrap_host, bootstrap_port and "
            "bootstrap_room (send them through `pdserve router`)"
        )
    return "this is a colocated worker: requests must not carry bootstrap fields"


def _failed(msg: GenerateRequest, reason: str) -> TokenOutput:
    return TokenOutput(
        request_id=msg.request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        num_prompt_tokens=len(msg.prompt_token_ids),
        num_output_tokens=0,
        finish_reason="abort",
        error=reason,
        error_kind="invalid",
    )


def _to_wire(output: RequestOutput) -> TokenOutput:
    count = len(output.new_token_ids)
    top = None
    if output.top_logprobs is not None:
        top = [[[t, lp] for t, lp in entry.items()] for entry in output.top_logprobs[-count:]]
    return TokenOutput(
        request_id=output.request_id,
        new_token_ids=output.new_token_ids,
        new_text=output.new_text,
        finished=output.finished,
        num_prompt_tokens=len(output.prompt_token_ids),
        num_output_tokens=len(output.token_ids),
        finish_reason=output.finish_reason,
        stop_reason=output.stop_reason,
        error=output.error,
        error_kind=output.error_kind,
        new_logprobs=output.logprobs[-count:] if output.logprobs is not None else None,
        new_top_logprobs=top,
        spec_verify_ct=output.spec_verify_ct,
        spec_emitted_tokens=output.spec_emitted_tokens,
    )
