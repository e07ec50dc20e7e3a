"""Chat messages to prompt token ids, one way for every entry point (the chat endpoint,
train-eagle's prompt files, tests): the tokenizer's chat template renders the text, then the
tokenizer encodes it without adding special tokens of its own (the template writes them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def chat_prompt_ids(
    tokenizer, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True
) -> list[int]:
    text = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)
