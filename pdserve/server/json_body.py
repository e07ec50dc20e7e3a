"""Request bodies parsed strictly: standard JSON only, bounded nesting, valid Unicode.

Python's `json` accepts `NaN` and `Infinity` (not JSON; they break responses and the sampler),
strings with lone UTF-16 surrogates (`"\\ud800"`: no UTF-8 encoding exists, so the tokenizer
and the response encoder raise), and nesting as deep as the interpreter's recursion limit. Each
of these becomes a 400 naming the problem, through FastAPI's own invalid-JSON path.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute

# Real bodies nest 4 deep (chat content parts); anything far deeper is an attack on parsers.
MAX_JSON_DEPTH = 32


def parse_json(raw: bytes) -> Any:
    """`raw` as JSON, or json.JSONDecodeError with a message a client can act on."""
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise _invalid(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except UnicodeDecodeError:
        raise _invalid("the body is not valid UTF-8") from None
    except ValueError as e:  # e.g. an integer literal of more than 4300 digits
        raise _invalid(str(e)) from None
    _check_tree(value)
    return value


def _reject_constant(name: str) -> Any:
    raise _invalid(f"{name} is not valid JSON (numbers must be finite)")


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
            raise _invalid(f"nested deeper than {MAX_JSON_DEPTH} levels")
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
        raise _invalid("a string holds a lone UTF-16 surrogate (not valid Unicode)") from None


def _invalid(message: str) -> json.JSONDecodeError:
    return json.JSONDecodeError(message, "", 0)


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """Routes whose JSON bodies go through `parse_json`."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict_handler(request: Request):
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler
