"""Per-request sampling settings, validated once at the edge.

Torch-free so the HTTP front end (issue 3) can build and check them without importing torch.
Field names follow vLLM's `SamplingParams` so users can carry settings over unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; the message names the parameter."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature == 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p == 1 and
    min_p == 0 disable those filters. Penalties follow OpenAI (presence, frequency: over the
    generated tokens) and HF/vLLM (repetition: over prompt and generated tokens).
    `logprobs` asks for the sampled token's logprob plus that many top alternatives
    (0 = the sampled token only, None = nothing). Logprobs are those of the model's raw
    distribution, before penalties and temperature (as vLLM reports them by default).
    """

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        # NOTE: accept a single stop string / lists from callers, store tuples (hashable, frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidSamplingParams(param, message)

        check(isinstance(self.max_new_tokens, int), "max_new_tokens", "must be an integer")
        check(
            self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}"
        )
        check(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            f"must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}",
        )
        check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        check(
            self.top_k == -1 or self.top_k >= 0,
            "top_k",
            f"must be -1 (disabled), 0 (disabled) or positive, got {self.top_k}",
        )
        check(
            self.repetition_penalty > 0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        check(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        check(
            -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            f"must be non-negative token ids, got {list(self.stop_token_ids)}",
        )
        check(
            self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS,
            "logprobs",
            f"must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}",
        )
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )
