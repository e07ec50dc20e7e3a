"""Chat messages to prompt token ids, one way for every entry point (the chat endpoint,
train-eagle's prompt files, tests): the tokenizer's chat template renders the text, then the
tokenizer encodes it without adding special tokens of its own (the template writes them).

`--chat-template` replaces the tokenizer's template (a file, or the template itself, as vLLM
takes it); a request's `chat_template_kwargs` (`enable_thinking`, ...) reach the template as
variables, as in vLLM and SGLang.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

# apply_chat_template's own arguments: a request's template variables cannot override them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ChatTemplateError(ValueError):
    """`--chat-template` is neither a readable file nor a valid Jinja template."""


def chat_prompt_ids(
    tokenizer,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {}))
    if reserved:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)}")
    text = tokenizer.apply_chat_template(
        list(messages),
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **(template_kwargs or {}),
    )
    return tokenizer.encode(text, add_special_tokens=False)


def load_chat_template(given: str) -> str:
    """The template `--chat-template` names: a file's text, or `given` itself when it is a
    template (it holds Jinja markup). Checked to compile, so a broken one fails at start-up,
    not at the first chat request."""
    import jinja2

    if os.path.isfile(given):
        try:
            with open(given, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"--chat-template {given}: cannot read it: {e}") from None
    elif "{{" in given or "{%" in given:
        template = given
    else:
        raise ChatTemplateError(
            f"--chat-template {given!r}: no such file, and not a Jinja template either"
        )
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"--chat-template: not a valid Jinja template (line {e.lineno}: {e.message})"
        ) from None
    return template
