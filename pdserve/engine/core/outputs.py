"""What the engine reports about a request after a step. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.protocol.engine_messages import FinishReason
from pdserve.protocol.failures import Failure


@dataclass
class RequestOutput:
    """A request's state after a step: cumulative tokens, plus those new since the previous
    output (for streaming). The cumulative lists (`token_ids`, `logprobs`, `top_logprobs`)
    are the request's own and keep growing while it runs: copy them to keep a snapshot.
    `finish_reason` is set once `finished`; `stop_reason` is the stop token id or stop string
    that matched, if any.

    Token-level: `Engine.step()` leaves `text` None. Text is made from the ids by a
    `RequestDetokenizer` outside the engine (detokenizer.py): `LLM.generate` fills `text` of
    the outputs it returns; a worker's front end streams it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Why it failed, if it did: its kind decides the HTTP status and whether a router retries
    # (protocol/failures.py).
    failure: Failure | None = None
    # Every output token's logprob and top-N so far (for offline use: `LLM.generate`).
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    # Those of `new_token_ids` only, taken when this output was made: the cumulative lists
    # above keep growing while the request runs, so a slice of them taken later (after the
    # next step) would name later tokens.
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[dict[int, float]] | None = None
    prompt: str | None = None
    # All output text, stop strings applied (filled by `LLM.generate`; None from the engine).
    text: str | None = None
    # Speculative decoding: verify steps so far and the tokens they emitted.
    spec_verify_ct: int = 0
    spec_emitted_tokens: int = 0
    # Prompt tokens whose KV came from the prefix cache (not computed for this request).
    num_cached_tokens: int = 0

    @classmethod
    def failed(cls, request_id: str, prompt_ids: list[int], failure: Failure) -> RequestOutput:
        """The output of a request that failed before producing anything it reports."""
        return cls(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            token_ids=[],
            new_token_ids=[],
            finished=True,
            finish_reason=FinishReason.ABORT,
            failure=failure,
        )

    @property
    def error(self) -> str | None:
        """The failure's message, None if the request did not fail."""
        return None if self.failure is None else self.failure.message
