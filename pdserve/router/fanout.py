"""A request with several prompts or choices (n > 1) split into parts, and their answers
merged back into one (docs/architecture/request-flow.md). Torch-free.

Disaggregated workers take one prompt and one choice per request (each its own room), so the
router splits: one part, a body of its own, per (prompt, choice), in the order colocated
`pdserve serve` numbers its choices (prompt by prompt, choice by choice: index = prompt * n +
choice). Choice i of a seeded request gets seed + i (wrapped within int64), as colocated mode
gives it, so the answers match.

What the router cannot split it sends on as it is, for a worker to refuse with the reason:
an `n` that is not an integer in [2, MAX_N], a prompt list of mixed or wrong types.

Merging: one response with the first part's id, choices renumbered, usage summed (a prompt's
tokens once, however many choices it has); /generate answers a list. Streams interleave the
parts' events as they come, each choice renumbered and all under one id; the usage chunk
(with `stream_options.include_usage`) and `[DONE]` come once, at the end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.errors import worker_outcome

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_N = 128  # the workers' bound on n
DONE = b"data: [DONE]\n\n"
SSE_EVENT_END = b"\n\n"


class TooManyParts(ValueError):
    """The request asks for more parts (prompts x choices) than the router allows (400), or
    its parts' bodies would add up to more bytes than it allows (413)."""

    def __init__(self, message: str, param: str | None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass(frozen=True)
class Part:
    """One part's body, and whether it is its prompt's first choice (usage counts a prompt's
    tokens once)."""

    body: dict[str, Any]
    first_of_prompt: bool


def split(endpoint: str, body: dict[str, Any], limit: int, max_bytes: int) -> list[Part]:
    """The parts of a request, in choice order; one part (the body as it is) for a single
    prompt with n = 1, or for a body the router cannot split. Raises TooManyParts past
    `limit` parts (before any part's body is built) or `max_bytes` of part bodies in all
    (each part carries the body's other fields: 128 choices of a long prompt, or a prompt
    list beside a large field, would multiply what the router sends)."""
    key, prompts = _prompts(endpoint, body)
    n = body.get("n", 1)
    choices = n if type(n) is int and 2 <= n <= MAX_N else 1
    if key is None and choices == 1:
        return [Part(body, True)]
    if len(prompts) * choices > limit:
        raise TooManyParts(
            f"{len(prompts)} prompts x {choices} choices is over this router's limit of "
            f"{limit} rooms per request (--max-rooms-per-request)",
            param="n" if choices > 1 else key,
        )
    parts, size = [], 0
    for p, prompt in enumerate(prompts):
        for choice in range(choices):
            part = dict(body)
            if key is not None:
                part[key] = prompt
                if endpoint == "/generate" and isinstance(body.get("rid"), str):
                    part["rid"] = f"{body['rid']}-{p}"
            if choices > 1:
                part["n"] = 1
                if type(body.get("seed")) is int and INT64_MIN <= body["seed"] <= INT64_MAX:
                    part["seed"] = (body["seed"] + choice - INT64_MIN) % (1 << 64) + INT64_MIN
            if choice == 0:
                # NOTE: a prompt's choices differ only in their seed: measured once.
                size += len(json.dumps(part)) * choices
                if size > max_bytes:
                    raise TooManyParts(
                        f"its {len(prompts) * choices} rooms would carry over {max_bytes} "
                        "bytes in all (twice the router's --max-body-size)",
                        param=None,
                        status=413,
                    )
            parts.append(Part(part, choice == 0))
    return parts


def _prompts(endpoint: str, body: dict) -> tuple[str | None, list]:
    """The field holding a prompt list and the list; (None, [one entry]) for one prompt or
    a body whose prompts are not a non-empty list of strings or of token-id lists."""
    if endpoint == "/v1/completions":
        prompt = body.get("prompt")
        if _is_list_of(prompt, str) or _is_list_of(prompt, list):
            return "prompt", prompt
    elif endpoint == "/generate":
        if _is_list_of(body.get("text"), str) and body.get("input_ids") is None:
            return "text", body["text"]
        if _is_list_of(body.get("input_ids"), list) and body.get("text") is None:
            return "input_ids", body["input_ids"]
    return None, [None]


def _is_list_of(value: Any, kind: type) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, kind) for v in value)


# ---- answers -----------------------------------------------------------------------------


class BadAnswer(ValueError):
    """A worker's answer the router cannot merge (not the JSON an endpoint answers)."""


def merge_bodies(endpoint: str, parts: list[Part], bodies: list[bytes]) -> bytes:
    """The parts' whole (non-streamed) answers as one."""
    try:
        answers = [json.loads(b) for b in bodies]
        if endpoint == "/generate":
            return json.dumps(answers).encode()
        merged = dict(answers[0])
        merged["choices"] = [
            {**choice, "index": index}
            for index, answer in enumerate(answers)
            for choice in answer["choices"]
        ]
        if all("usage" in a for a in answers):
            merged["usage"] = _usage(parts, [a["usage"] for a in answers])
        return json.dumps(merged).encode()
    except (ValueError, KeyError, TypeError) as e:
        raise BadAnswer(f"a decode worker's answer could not be merged: {e}") from None


def _usage(parts: list[Part], usages: list[dict]) -> dict:
    prompt = sum(u["prompt_tokens"] for part, u in zip(parts, usages, strict=True)
                 if part.first_of_prompt)  # fmt: skip
    completion = sum(u["completion_tokens"] for u in usages)
    merged = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    details = [u.get("prompt_tokens_details") for u in usages]
    if all(isinstance(d, dict) for d in details):
        cached = sum(d.get("cached_tokens") or 0 for part, d in zip(parts, details, strict=True)
                     if part.first_of_prompt)  # fmt: skip
        merged["prompt_tokens_details"] = {"cached_tokens": cached}
    return merged


class RoomFailed(Exception):
    """A part's stream ended in an error event: the merged stream ends with it."""

    def __init__(self, error: dict):
        super().__init__(str(error.get("message")))
        self.event = _event({"error": error})
        self.status = worker_outcome(error).status


@dataclass
class StreamMerge:
    """Rewrites the parts' SSE streams into one: `feed` each part's bytes as they come, send
    what it returns; after every part's `[DONE]`, send `end()`."""

    endpoint: str
    parts: list[Part]
    stream_id: str | None = None  # the merged stream's id: the first part's
    _buffers: list[bytes] = field(default_factory=list)
    _usages: list[dict | None] = field(default_factory=list)
    _finished: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._buffers = [b""] * len(self.parts)
        self._usages = [None] * len(self.parts)

    @property
    def done(self) -> bool:
        return len(self._finished) == len(self.parts)

    def finished(self, index: int) -> bool:
        """Whether part `index` sent its `[DONE]`."""
        return index in self._finished

    def feed(self, index: int, chunk: bytes) -> bytes:
        """Room `index`'s next bytes; returns the complete events among them, rewritten.
        Raises RoomFailed on an error event, BadAnswer on an event that is not JSON."""
        buffer = self._buffers[index] + chunk
        *events, self._buffers[index] = buffer.split(SSE_EVENT_END)
        return b"".join(self._rewrite(index, event) for event in events if event.strip())

    def end(self) -> bytes:
        usage = b""
        if all(u is not None for u in self._usages) and self.endpoint != "/generate":
            total = _usage(self.parts, [u["usage"] for u in self._usages])
            usage = _event({**self._usages[0], "id": self.stream_id, "usage": total})
        return usage + DONE

    def _rewrite(self, index: int, event: bytes) -> bytes:
        data = event.strip()
        if not data.startswith(b"data:"):
            return b""  # NOTE: comments and other fields carry nothing a client needs
        data = data[5:].strip()
        if data == b"[DONE]":
            self._finished.add(index)
            return b""
        try:
            body = json.loads(data)
        except ValueError:
            raise BadAnswer(
                f"a decode worker sent an event that is not JSON: {data[:80]!r}"
            ) from None
        if not isinstance(body, dict):
            raise BadAnswer("a decode worker sent an event that is not a JSON object")
        if isinstance(body.get("error"), dict):
            raise RoomFailed(body["error"])
        if self.endpoint == "/generate":
            return _event({**body, "index": index})
        if body.get("choices") == [] and "usage" in body:
            self._usages[index] = body
            return b""
        self.stream_id = self.stream_id or body.get("id")
        choices = [{**c, "index": index} for c in body.get("choices", [])]
        return _event({**body, "id": self.stream_id, "choices": choices})


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + SSE_EVENT_END
