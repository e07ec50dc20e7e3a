"""Per-request sampling settings, validated once at the edge.

Torch-free so the HTTP front end (issue 3) can build and check them without importing torch.
Field names follow vLLM's `SamplingParams` so users can carry settings over unchanged.

Every field is checked for its type and its bounds here, the one place of truth for the HTTP
APIs, the engine process (which validates again what arrives over ZMQ) and `LLM`. The bounds
keep the sampler's arithmetic finite in float32 and every integer inside what msgpack and
`torch.Generator` take (int64); a request that is out of bounds gets a message naming the
field, never a crash later in the engine.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1


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
    # NOTE: a temperature in (0, MIN_TEMPERATURE) samples at MIN_TEMPERATURE: the logits
    # divided by it stay finite in float32 (|logit| * 1e5 is far below 3.4e38 even after the
    # largest penalties), and such a distribution is the argmax to float32 precision anyway.
    MIN_TEMPERATURE = 1e-5
    MAX_TEMPERATURE = 1e4
    # The repetition penalty divides or multiplies logits: bounded on both sides so the result
    # stays finite (1e-40 used to turn logits into inf and the softmax into NaN).
    MIN_REPETITION_PENALTY = 1e-2
    MAX_REPETITION_PENALTY = 1e2
    # Stop strings are searched after every token of the request (OpenAI allows 4).
    MAX_STOP_STRINGS = 32
    MAX_STOP_STRING_CHARS = 256
    MAX_STOP_TOKEN_IDS = 256

    def __post_init__(self) -> None:
        # NOTE: accept a single stop string / lists from callers, store tuples (hashable, frozen).
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        self._check_types()
        self._validate()

    def _check_types(self) -> None:
        for name in ("max_new_tokens", "min_new_tokens", "top_k"):
            _require_int(name, getattr(self, name))
        for name in ("seed", "logprobs"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name))
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            _require_number(name, getattr(self, name))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParams(
                    name, f"must be true or false, got {getattr(self, name)!r}"
                )

    def _validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidSamplingParams(param, message)

        check(
            1 <= self.max_new_tokens <= INT64_MAX,
            "max_new_tokens",
            f"must be in [1, 2**63 - 1], got {_describe(self.max_new_tokens)}",
        )
        check(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            f"must be in [0, max_new_tokens={self.max_new_tokens}], "
            f"got {_describe(self.min_new_tokens)}",
        )
        check(
            0 <= self.temperature <= self.MAX_TEMPERATURE,
            "temperature",
            f"must be in [0, {self.MAX_TEMPERATURE:g}], got {self.temperature}",
        )
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        check(
            self.top_k == -1 or 0 <= self.top_k <= INT64_MAX,
            "top_k",
            f"must be -1 (disabled), 0 (disabled) or positive, got {_describe(self.top_k)}",
        )
        check(
            self.MIN_REPETITION_PENALTY <= self.repetition_penalty <= self.MAX_REPETITION_PENALTY,
            "repetition_penalty",
            f"must be in [{self.MIN_REPETITION_PENALTY:g}, {self.MAX_REPETITION_PENALTY:g}], "
            f"got {self.repetition_penalty}",
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
        self._validate_stops(check)
        check(
            self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS,
            "logprobs",
            f"must be in [0, {self.MAX_LOGPROBS}], got {_describe(self.logprobs)}",
        )
        check(
            self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
            "seed",
            f"must be in [-2**63, 2**63 - 1], got {_describe(self.seed)}",
        )

    def _validate_stops(self, check) -> None:
        check(
            len(self.stop) <= self.MAX_STOP_STRINGS,
            "stop",
            f"at most {self.MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
        )
        check(all(self.stop), "stop", "stop strings must be non-empty")
        longest = max((len(s) for s in self.stop), default=0)
        check(
            longest <= self.MAX_STOP_STRING_CHARS,
            "stop",
            f"stop strings are at most {self.MAX_STOP_STRING_CHARS} characters, got {longest}",
        )
        check(
            len(self.stop_token_ids) <= self.MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"at most {self.MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
        )
        bad = [_describe(t) for t in self.stop_token_ids if not 0 <= t <= INT64_MAX]
        check(not bad, "stop_token_ids", f"must be non-negative token ids, got {bad[:5]}")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids this request names must exist in the model's vocabulary."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise InvalidSamplingParams(
                "stop_token_ids", f"token ids must be in [0, {vocab_size}), got {bad[:5]}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def sampling_temperature(self) -> float:
        """The temperature logits are divided by (see MIN_TEMPERATURE)."""
        return max(self.temperature, self.MIN_TEMPERATURE)

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


# What Python callers pass as a list of stop strings or ids (JSON gives lists).
_SEQUENCES = (list, tuple, range, set, frozenset)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(name: str, value: Any) -> None:
    if not _is_int(value):
        raise InvalidSamplingParams(name, f"must be an integer, got {_describe(value)}")


def _require_number(name: str, value: Any) -> None:
    if not (_is_int(value) or isinstance(value, float)):
        raise InvalidSamplingParams(name, f"must be a number, got {_describe(value)}")
    # NOTE: an int past float's range is no finite float (math.isfinite would overflow).
    if (_is_int(value) and abs(value) > sys.float_info.max) or not math.isfinite(value):
        raise InvalidSamplingParams(name, f"must be a finite number, got {_describe(value)}")


def _stop_strings(stop: Any) -> tuple[str, ...]:
    values = (stop,) if isinstance(stop, str) else stop
    if not isinstance(values, _SEQUENCES) or not all(isinstance(s, str) for s in values):
        raise InvalidSamplingParams(
            "stop", f"must be a string or a list of strings, got {_describe(stop)}"
        )
    return tuple(values)


def _token_ids(ids: Any) -> tuple[int, ...]:
    if not isinstance(ids, _SEQUENCES) or not all(_is_int(t) for t in ids):
        raise InvalidSamplingParams(
            "stop_token_ids", f"must be a list of integers, got {_describe(ids)}"
        )
    return tuple(ids)


def _describe(value: Any) -> str:
    """A short description of a value for an error message (never a huge one in full)."""
    if _is_int(value) and value.bit_length() > 64:
        return "an integer beyond 64 bits"
    if isinstance(value, (bool, int, float, type(None))):
        return repr(value)
    if isinstance(value, str) and len(value) <= 40:
        return repr(value)
    return f"a {type(value).__name__}"
