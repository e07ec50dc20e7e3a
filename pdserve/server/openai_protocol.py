"""OpenAI request bodies as vLLM and SGLang accept them (plus their sampling extensions).

Types are strict, as OpenAI's API is typed: `"4"`, `true` or `4.0` where an integer belongs,
`"0.5"` or `true` where a number belongs and `"true"` or `1` where a boolean belongs are
refused by pydantic's strict mode (an integer is a number: `temperature: 1` is fine), which
becomes a 400 naming the field. OpenAI's fields, and vLLM's and SGLang's own extensions, that
this server does not implement are refused (`UNSUPPORTED`) rather than silently ignored: a
client that asks for structured output or tool calls must not get unconstrained text with a
200. Other unknown fields are ignored. Range checks live in `SamplingParams`, so every API
shares one set of rules.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.server.errors import bad_request

# The value of `n`, where a field may equal it (best_of).
N = object()
# vLLM's and SGLang's request extensions this server does not implement (structured outputs,
# reasoning and tool-call settings, logits shaping, beam search), both endpoints: any value
# but null (or what asks for nothing) is a 400 naming the field.
_EXTENSIONS: dict[str, tuple] = {
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "structured_outputs": (None,),
    "structural_tag": (None,),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "response_format": (None, {"type": "text"}),
    "logits_processors": (None, []),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "prompt_logprobs": (None,),
    "use_beam_search": (None, False),
    "truncate_prompt_tokens": (None,),
    "spaces_between_special_tokens": (None, True),
    "return_tokens_as_token_ids": (None, False),
    "priority": (None, 0),
    "lora_path": (None,),
    "no_stop_trim": (None, False),
    "return_hidden_states": (None, False),
    # NOTE: vLLM salts the prefix cache with it (tenants cannot probe each other's
    # prompts); ignored, it would promise an isolation that is not there.
    "cache_salt": (None,),
}
# OpenAI's fields and the extensions above that this server does not implement, by endpoint,
# with the values that mean "not used" (accepted; so are absent fields). Any other value is a
# 400 naming the field.
UNSUPPORTED: dict[str, dict[str, tuple]] = {
    "chat": {
        **_EXTENSIONS,
        "tools": (None, []),
        "tool_choice": (None, "none"),
        "functions": (None, []),
        "function_call": (None, "none"),
        "logit_bias": (None, {}),
        "audio": (None,),
        "modalities": (None, ["text"]),
        "prediction": (None,),
        "web_search_options": (None,),
        "parallel_tool_calls": (None,),
        "reasoning_effort": (None,),
        "chat_template": (None,),
        "documents": (None, []),
        "continue_final_message": (None, False),
        "echo": (None, False),
        # NOTE: the chat prompt gets no special tokens beyond the template's, as in vLLM.
        "add_special_tokens": (None, False),
    },
    "completions": {
        **_EXTENSIONS,
        "echo": (None, False),
        "suffix": (None, ""),
        "logit_bias": (None, {}),
        "best_of": (None, 1, N),
        "add_special_tokens": (None, True),
    },
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    # NOTE: extras kept, for check_supported to refuse UNSUPPORTED_STREAM_OPTIONS.
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool = False


# `stream_options` keys of vLLM's that this server does not implement (usage in every chunk),
# with the values that mean "not used", as in UNSUPPORTED.
UNSUPPORTED_STREAM_OPTIONS: dict[str, tuple] = {"continuous_usage_stats": (None, False)}


class SamplingFields(_Body):
    """Fields both endpoints share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # Extensions benchmark clients send (vLLM / SGLang names).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # SGLang's PD fields (prefill and decode workers only; the router sets them).
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


class _Request(SamplingFields):
    """A top-level body: keeps its unknown fields (`model_extra`) so that `check_supported`
    can find the unsupported ones."""

    model_config = ConfigDict(extra="allow", strict=True)
    endpoint: ClassVar[str]


class CompletionRequest(_Request):
    endpoint: ClassVar[str] = "completions"

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Request):
    endpoint: ClassVar[str] = "chat"

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # Variables for the chat template (vLLM's and SGLang's name), e.g. `enable_thinking`.
    chat_template_kwargs: dict[str, Any] | None = None


def check_supported(body: _Request) -> None:
    """Refuse (400 naming the field) the first field of UNSUPPORTED (or, in
    `stream_options`, of UNSUPPORTED_STREAM_OPTIONS) the body uses."""
    _refuse_used(body.model_extra or {}, UNSUPPORTED[body.endpoint], body.n, "")
    if body.stream_options is not None:
        extra = body.stream_options.model_extra or {}
        _refuse_used(extra, UNSUPPORTED_STREAM_OPTIONS, body.n, "stream_options.")


def _refuse_used(extra: dict[str, Any], unsupported: dict[str, tuple], n: int, where: str):
    for field, unused in unsupported.items():
        value = extra.get(field)
        accepted = [n if u is N else u for u in unused]
        if not any(_same(value, u) for u in accepted):
            alternatives = " or ".join(
                "the value of n" if u is N else json.dumps(u) for u in unused if u is not None
            )
            instead = f"omit it or send {alternatives}" if alternatives else "omit it"
            name = where + field
            raise bad_request(f"{name} is not supported by this server; {instead}", name)


def _same(value: Any, unused: Any) -> bool:
    """Equal and of the same JSON type (`true == 1` in Python)."""
    return type(value) is type(unused) and value == unused
