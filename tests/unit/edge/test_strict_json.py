"""Client bodies are parsed strictly and read with a size bound (router and workers share it)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.edge.strict_json import (
    MAX_JSON_DEPTH,
    BodyTooLarge,
    InvalidJSON,
    parse_json,
    read_bounded,
)


def test_standard_json_parses():
    assert parse_json(b'{"a": [1, 2.5, "\\u00e9", null, true]}') == {"a": [1, 2.5, "é", None, True]}


@pytest.mark.parametrize(
    ("raw", "word"),
    [
        (b'{"t": NaN}', "NaN"),
        (b'{"t": -Infinity}', "Infinity"),
        (b'{"t": "\\ud800"}', "surrogate"),
        (b'{"\\udfff": 1}', "surrogate"),
        (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "nested"),
        (b"[" * 100_000 + b"]" * 100_000, "nested"),
        (b'{"seed": 1' + b"0" * 5000 + b"}", "digits"),
        (b'{"t": "\xff"}', "UTF-8"),
        (b"{oops", "Expecting"),
    ],
)
def test_what_python_json_would_accept_or_crash_on_is_invalid(raw, word):
    with pytest.raises(InvalidJSON, match=word):
        parse_json(raw)


def test_nesting_at_the_limit_parses():
    raw = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert parse_json(raw) is not None


async def _chunks(sizes, seen):
    for size in sizes:
        seen.append(size)
        yield b"x" * size


def test_a_body_is_refused_as_soon_as_it_passes_the_limit():
    seen: list[int] = []
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_bounded(_chunks([60, 60, 60, 60], seen), None, limit=100))
    assert seen == [60, 60]  # the rest was never read


def test_a_declared_length_over_the_limit_is_refused_before_any_chunk():
    seen: list[int] = []
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_bounded(_chunks([10], seen), "101", limit=100))
    assert seen == []
    assert asyncio.run(read_bounded(_chunks([50, 50], seen), "100", limit=100)) == b"x" * 100
