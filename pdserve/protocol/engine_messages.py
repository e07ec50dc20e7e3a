"""Messages between a worker's HTTP front end and its engine process.

The front end tokenizes and validates; the engine process runs `Engine.step()` and sends back,
once per step, what every request produced. Sampling settings travel as a plain map of
`SamplingParams` fields, which the engine process validates again.
"""

from __future__ import annotations

from typing import Any

from pdserve.protocol.codec import message


@message("generate")
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]


@message("abort")
class AbortRequest:
    request_id: str


@message("shutdown")
class Shutdown:
    reason: str = ""


@message("token_output")
class TokenOutput:
    """What one request produced in one step (`new_*`), plus its finish state."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # One entry per new token: its logprob, and (token id, logprob) pairs of the top-N.
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[list[int | float]]] | None = None


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


@message("engine_failed")
class EngineFailed:
    reason: str
