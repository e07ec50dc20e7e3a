"""Comparing two servers' answers (tests/e2e/test_pd_fidelity.py, tests/gpu): whole JSON bodies
after `normalized` drops what differs between any two answers (ids, creation times,
latencies), floats to a tolerance; streams summarized per choice first."""

from __future__ import annotations

FLOAT_TOLERANCE = 1e-5


def normalized(body):
    """A response body (or one streamed event) without what differs between any two answers:
    ids, creation times, latencies, and how many prompt tokens came from a worker's prefix
    cache (that depends on what the worker served before, not on the answer)."""
    if isinstance(body, list):  # /generate with several prompts
        return [normalized(item) for item in body]
    body = {k: v for k, v in body.items() if k not in ("id", "created")}
    if "meta_info" in body:
        meta = body["meta_info"]
        dropped = ("id", "e2e_latency", "cached_tokens")
        body["meta_info"] = {k: v for k, v in meta.items() if k not in dropped}
    if isinstance(body.get("usage"), dict):
        body["usage"] = without_cached_tokens(body["usage"])
    return body


def without_cached_tokens(usage: dict) -> dict:
    """An OpenAI usage block without `prompt_tokens_details` (checked to be well formed)."""
    usage = dict(usage)
    details = usage.pop("prompt_tokens_details", None)
    if details is not None:
        cached = details["cached_tokens"]
        assert isinstance(cached, int) and 0 <= cached <= usage["prompt_tokens"], details
    return usage


def openai_stream(events: list[dict]) -> dict:
    """An OpenAI stream per choice index: the text and logprob entries its chunks carried,
    its finish chunk, its other chunks' fields (each distinct one once); and the usage chunk."""
    choices: dict[int, dict] = {}
    usage = None
    for event in map(normalized, events):
        if not event["choices"]:
            assert usage is None, "two usage chunks"
            usage = event
            continue
        for choice in event["choices"]:
            summary = choices.setdefault(
                choice["index"], {"text": "", "logprobs": [], "finish": None, "chunks": []}
            )
            rest = dict(choice)
            summary["text"] += _pop_text(rest)
            summary["logprobs"] += _entries(rest.pop("logprobs"))
            chunk = {**event, "choices": [rest]}
            if rest["finish_reason"] is not None:
                assert summary["finish"] is None, f"choice {choice['index']} finished twice"
                summary["finish"] = chunk
            elif chunk not in summary["chunks"]:
                summary["chunks"].append(chunk)
    return {"choices": choices, "usage": usage}


def _pop_text(choice: dict) -> str:
    if "text" in choice:
        return choice.pop("text")
    delta = dict(choice["delta"])
    text = delta.pop("content", "")
    choice["delta"] = delta
    return text


def _entries(logprobs: dict | None) -> list[dict]:
    """A chunk's logprobs as one entry per token: chat's `content` list, or completions'
    parallel lists (tokens, token_logprobs, top_logprobs, text_offset) zipped."""
    if logprobs is None:
        return []
    return [dict(zip(logprobs, row, strict=True)) for row in zip(*logprobs.values(), strict=True)]


def generate_stream(events: list[dict]) -> dict:
    """A /generate stream per index: its last event (each one carries everything so far)."""
    return {event["index"]: normalized(event) for event in events}


def assert_same(got, want, where: str = "answer", tolerance: float = FLOAT_TOLERANCE) -> None:
    """Equal JSON, floats to `tolerance`; says where the first difference is."""
    if isinstance(want, float) or isinstance(got, float):
        assert isinstance(got, int | float) and isinstance(want, int | float), (where, got, want)
        assert abs(got - want) <= tolerance, f"{where}: {got!r} != {want!r}"
    elif isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: {got!r} is not an object"
        assert got.keys() == want.keys(), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}", tolerance)
    elif isinstance(want, list):
        assert isinstance(got, list), f"{where}: {got!r} is not a list"
        assert len(got) == len(want), f"{where}: {len(got)} items != {len(want)}: {got} {want}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]", tolerance)
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def values_of(data, key: str) -> list:
    """Every value of `key` anywhere in a JSON structure."""
    if isinstance(data, dict):
        found = [data[key]] if key in data else []
        return found + [v for value in data.values() for v in values_of(value, key)]
    if isinstance(data, list):
        return [v for item in data for v in values_of(item, key)]
    return []
