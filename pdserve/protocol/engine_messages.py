"""Messages between a worker's HTTP front end and its engine process.

The front end tokenizes and validates; the engine process runs `Engine.step()` and sends back,
once per step, what every request produced. Sampling settings travel as a plain map of
`SamplingParams` fields, which the engine process validates again.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import field
from typing import Any

from pdserve.protocol.codec import message
from pdserve.protocol.failures import Failure, FailureKind
from pdserve.protocol.ids import RequestId, RoomId


@message("bootstrap")
class Bootstrap:
    """Where a disaggregated request's KV moves (SGLang's PD fields): the prefill worker's
    bootstrap endpoint and the room both legs of the request share."""

    host: str
    port: int
    room: RoomId


@message("generate")
class GenerateRequest:
    request_id: RequestId
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    bootstrap: Bootstrap | None = None


@message("abort")
class AbortRequest:
    request_id: RequestId


@message("fail_room")
class FailRoom:
    """A worker's front end refused a disaggregated request before it reached the engine:
    fail its room so the other side stops waiting at once. A decode worker tells the prefill
    worker at host:port."""

    room: RoomId
    reason: str
    host: str = ""
    port: int = 0
    kind: FailureKind = FailureKind.INVALID  # ABORTED when a router gave up on the room


@message("shutdown")
class Shutdown:
    reason: str = ""


class FinishReason(enum.StrEnum):
    """Why a request ended, as OpenAI's `finish_reason` names it (the wire carries the value
    and the codec refuses any other)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # aborted by the caller or failed


@message("token_output")
class TokenOutput:
    """What one request produced in one step (`new_*`), plus its finish state.

    Token ids only: the front end makes the text (engine/text/detokenizer.py), so the engine spends
    no time decoding for clients. Stop strings are the engine's decision (`finish_reason`,
    `stop_reason`); the front end's detokenizer, fed these ids, cuts the text at the same
    place."""

    request_id: RequestId
    new_token_ids: list[int]
    finished: bool
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    failure: Failure | None = None
    # One entry per new token: its logprob, and (token id, logprob) pairs of the top-N.
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[list[int | float]]] | None = None
    # Speculative decoding, cumulative: verify steps and the tokens they emitted.
    spec_verify_ct: int = 0
    spec_emitted_tokens: int = 0
    # Prompt tokens this worker took from its prefix cache instead of computing them.
    num_cached_tokens: int = 0

    @classmethod
    def failed(
        cls, request_id: RequestId, failure: Failure, num_prompt_tokens: int = 0
    ) -> TokenOutput:
        """The last output of a request that failed before it produced anything."""
        return cls(
            request_id=request_id,
            new_token_ids=[],
            finished=True,
            num_prompt_tokens=num_prompt_tokens,
            num_output_tokens=0,
            finish_reason=FinishReason.ABORT,
            failure=failure,
        )

    @property
    def error(self) -> str | None:
        """The failure's message, None if the request did not fail."""
        return None if self.failure is None else self.failure.message

    def followed_by(self, later: TokenOutput) -> TokenOutput:
        """This output and the request's next one (this one neither finished nor failed) as
        one: the new tokens (and their logprobs) of both, the state of the later."""
        logprobs, top = self.new_logprobs, self.new_top_logprobs
        if later.new_logprobs is not None:
            logprobs = (logprobs or []) + later.new_logprobs
        if later.new_top_logprobs is not None:
            top = (top or []) + later.new_top_logprobs
        return dataclasses.replace(
            later,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            new_logprobs=logprobs,
            new_top_logprobs=top,
        )


@message("disagg_stats")
class DisaggStats:
    """A prefill or decode worker's handoff queues and transfer counters. Counters are
    cumulative; `transfer_latencies` lists the rooms finished since the previous report."""

    num_bootstrapping: int = 0  # prefill: waiting for decode's reservation
    num_prealloc: int = 0  # decode: waiting for free pages
    num_transferring: int = 0  # KV on the way (both sides)
    num_prefilling: int = 0  # prefill: computing, pages to be sent
    # decode (ipc): failed rooms whose pages wait until prefill's writes into them are over
    num_held_back: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_skipped: int = 0  # decode: KV its prefix cache held, so not transferred
    transfers_succeeded: int = 0
    transfer_latencies: list[float] = field(default_factory=list)
    # Failure.label ("stage/kind") -> count.
    failures: dict[str, int] = field(default_factory=dict)
    malformed_messages: int = 0  # peer messages dropped by the schema checks


@message("engine_stats")
class EngineStats:
    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    # Cumulative since start: steps run, seconds inside them, tokens they computed.
    num_steps: int = 0
    step_seconds: float = 0.0
    batched_tokens: int = 0
    # Prefix caching: pages the cache holds (in use or not), pages it evicted since start.
    kv_pages_cached: int = 0
    prefix_cache_evictions: int = 0
    disagg: DisaggStats | None = None


@message("step_outputs")
class StepOutputs:
    outputs: list[TokenOutput]
    stats: EngineStats


@message("engine_ready")
class EngineReady:
    model_path: str
    architecture: str
    max_model_len: int
    vocab_size: int
    kv_pages_total: int
    page_size: int
    device: str
    dtype: str
    role: str = "colocated"
    bootstrap_port: int | None = None


@message("engine_failed")
class EngineFailed:
    reason: str
