"""vLLM's `POST /tokenize` and `POST /detokenize`, with its request and response shapes, so
that clients written against vLLM (prompt budgeting, benchmark tools) work unchanged.

/tokenize takes a `prompt`, or chat `messages` rendered by the chat template as
/v1/chat/completions renders them (same `add_generation_prompt` and `chat_template_kwargs`),
and answers `{"count", "max_model_len", "tokens", "token_strs"}`. /detokenize takes `tokens`
and answers `{"prompt"}`. Sizes are checked before the tokenizer sees anything.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, model_validator

from pdserve.server.errors import bad_request
from pdserve.server.generation import ServerState, check_model, check_text_size
from pdserve.server.json_body import StrictJSONRoute
from pdserve.server.openai_api import chat_contents, chat_prompt
from pdserve.server.openai_protocol import ChatMessage

router = APIRouter(route_class=StrictJSONRoute)


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]


def _state(request: Request) -> ServerState:
    return request.app.state.pdserve


@router.post("/tokenize")
async def tokenize(body: TokenizeBody, request: Request) -> dict:
    state = _state(request)
    check_model(state, body.model)
    if body.prompt is not None:
        check_text_size(state, [len(body.prompt)])
        # NOTE: vLLM's default: a prompt gets the tokenizer's special tokens (as a completion
        # prompt does), chat messages none beyond what the template writes.
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await asyncio.to_thread(
            state.tokenizer.encode, body.prompt, add_special_tokens=special
        )
    else:
        ids = await asyncio.to_thread(_chat_ids, state, body)
    return {
        "count": len(ids),
        "max_model_len": state.max_model_len,
        "tokens": ids,
        "token_strs": [state.token_texts(t) for t in ids] if body.return_token_strs else None,
    }


def _chat_ids(state: ServerState, body: TokenizeBody) -> list[int]:
    messages = body.messages or []
    contents = chat_contents(state, messages)
    ids = chat_prompt(
        state, messages, contents, body.add_generation_prompt, body.chat_template_kwargs
    )
    if body.add_special_tokens:
        ids = state.tokenizer.build_inputs_with_special_tokens(ids)
    return ids


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, request: Request) -> dict:
    state = _state(request)
    check_model(state, body.model)
    # NOTE: a detokenized text is at most a few characters a token; the context bounds the
    # list as it bounds a prompt.
    if len(body.tokens) > state.max_model_len:
        raise bad_request(
            f"{len(body.tokens)} tokens is over the {state.max_model_len}-token context",
            param="tokens",
        )
    vocab = state.client.ready.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise bad_request(f"token ids must be in [0, {vocab})", param="tokens")
    text = await asyncio.to_thread(state.tokenizer.decode, body.tokens)
    return {"prompt": text}
