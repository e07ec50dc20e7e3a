"""Request bodies parsed strictly: standard JSON only, bounded size and nesting, valid Unicode.
Torch-free: the router and the workers parse client bodies with it.

Python's `json` accepts `NaN` and `Infinity` (not JSON; they break responses and the sampler),
strings with lone UTF-16 surrogates (`"\\ud800"`: no UTF-8 encoding exists, so the tokenizer
and the response encoder raise), and nesting as deep as the interpreter's recursion limit
(past it, RecursionError). Each of these is an `InvalidJSON` naming the problem.
"""

from __future__ import annotations

import json
from typing import Any

# Real bodies nest 4 deep (chat content parts); anything far deeper is an attack on parsers.
MAX_JSON_DEPTH = 32
# A 128k-token prompt is about 1 MiB of JSON: 32 MiB leaves room for long chats and token-id
# lists while capping what one client can make a server hold.
MAX_BODY_BYTES = 32 << 20


class InvalidJSON(ValueError):
    """The body is not a standard JSON document a server accepts; the message says why."""


class BodyTooLarge(ValueError):
    def __init__(self, limit: int):
        super().__init__(f"request body over {limit} bytes")
        self.limit = limit


def parse_json(raw: bytes) -> Any:
    """`raw` as JSON, or InvalidJSON with a message a client can act on."""
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except InvalidJSON:
        raise
    except RecursionError:
        raise InvalidJSON(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except UnicodeDecodeError:
        raise InvalidJSON("the body is not valid UTF-8") from None
    except ValueError as e:  # malformed, or an integer literal of more than 4300 digits
        raise InvalidJSON(str(e)) from None
    _check_tree(value)
    return value


async def read_bounded(chunks, declared_length: str | None, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body from its async iterator of chunks, refused (BodyTooLarge) as soon as it passes
    `limit` bytes, or at once when its Content-Length says it will: never held past `limit`."""
    if declared_length and declared_length.isdigit() and int(declared_length) > limit:
        raise BodyTooLarge(limit)
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        parts.append(chunk)
    return b"".join(parts)


def _reject_constant(name: str) -> Any:
    raise InvalidJSON(f"{name} is not valid JSON (numbers must be finite)")


def _check_tree(value: Any) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
            continue
        if not isinstance(item, (list, dict)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise InvalidJSON(f"nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            for key, child in item.items():
                _check_text(key)
                stack.append((child, depth + 1))
        else:
            stack.extend((child, depth + 1) for child in item)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidJSON("a string holds a lone UTF-16 surrogate (not valid Unicode)") from None
