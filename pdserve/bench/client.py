"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Timing rules (every time is seconds from just before the request is sent):
- A chunk carries output when a choice has text (completions), content or reasoning content
  (chat), or logprobs for tokens. TTFT is the first such chunk's arrival; when no chunk
  carries any (a server that sends no text until the end), the first chunk with a
  finish_reason stands in for it.
- ITL is the list of gaps between consecutive output-carrying chunks: chunk gaps, not token
  gaps, so a chunk that carries several tokens (speculative decoding, a detokenizer holding
  back an incomplete character) makes one longer gap. Servers that skip chunks for tokens
  without text send one per token when asked for logprobs (`ClientSettings.logprobs = 0`).
- Output tokens come from the usage chunk when the server sends one, else from the
  logprobs' tokens, else one per output-carrying chunk.
- A request fails on a non-200 status, an SSE error event, a stream that ends without
  `data: [DONE]`, a transport error or the timeout; the failure's message is kept and the
  caller goes on.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.bench.workloads import Conversation

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class ServerUnreachable(Exception):
    """The base URL did not answer at all (connection refused, DNS, timeout)."""


class NoModelList(Exception):
    """/v1/models answered, but not with a list of models (an error status, another API)."""


@dataclass(frozen=True)
class ClientSettings:
    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    timeout_s: float = 600.0
    temperature: float = 0.0
    ignore_eos: bool = True
    logprobs: int | None = None  # ask for logprobs (N alternatives) to get a chunk per token

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint {self.endpoint!r}: choose completions or chat")
        if self.timeout_s <= 0:
            raise ValueError("the request timeout must be > 0 s")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")


@dataclass
class RequestRecord:
    """One request's outcome. Times in seconds; `start_s` from the start of its run."""

    conversation: int = 0
    turn: int = 0
    max_tokens: int = 0
    success: bool = False
    error: str | None = None
    start_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    # Of those, the ones the server took from its prefix cache (its usage's
    # prompt_tokens_details.cached_tokens; None where it does not say).
    cached_tokens: int | None = None
    answer: str = ""  # the text received, for the next turn of a conversation

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output tokens - 1): None with fewer than two tokens."""
        if not self.success or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "conversation": self.conversation,
            "turn": self.turn,
            "success": self.success,
            "error": self.error,
            "start_s": self.start_s,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "itl_s": self.itl_s,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "max_tokens": self.max_tokens,
        }


def api_url(base_url: str, path: str) -> str:
    """`base_url` + `path`; a base URL that already ends in /v1 works too."""
    return base_url.rstrip("/").removesuffix("/v1") + path


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_models(
    base_url: str,
    api_key: str | None,
    timeout_s: float = 30.0,
    transport: httpx.BaseTransport | None = None,
) -> list[str]:
    """The model ids /v1/models lists. Raises ServerUnreachable, naming the URL, when nothing
    answers, and NoModelList when the answer is not a model list."""
    url = api_url(base_url, "/v1/models")
    try:
        with httpx.Client(transport=transport, timeout=timeout_s) as http:
            response = http.get(url, headers=auth_headers(api_key))
    except httpx.HTTPError as e:
        raise ServerUnreachable(f"cannot reach {url}: {_describe(e)}") from None
    if response.status_code != 200:
        message = _error_message(response.text)
        raise NoModelList(f"{url} answered HTTP {response.status_code}: {message}")
    try:
        data = response.json().get("data")
    except (ValueError, AttributeError):
        data = None
    if not isinstance(data, list):
        raise NoModelList(f"{url} answered no model list")
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


class BenchClient:
    """Sends conversation turns as streamed requests and times them (module docstring)."""

    def __init__(
        self,
        settings: ClientSettings,
        max_connections: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.settings = settings
        self.clock = clock
        self.url = api_url(settings.base_url, ENDPOINTS[settings.endpoint])
        # NOTE: no pool limit without a concurrency cap: httpx's default of 100 connections
        # would otherwise cap the load silently.
        self.http = httpx.AsyncClient(
            headers=auth_headers(settings.api_key),
            timeout=settings.timeout_s,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=None),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    def body(self, conversation: Conversation, answers: list[str]) -> dict[str, Any]:
        """The request for turn `len(answers)` of `conversation`."""
        s = self.settings
        turn = conversation.turns[len(answers)]
        body: dict[str, Any] = {
            "model": s.model,
            "max_tokens": turn.max_tokens,
            "temperature": s.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if s.ignore_eos:
            body["ignore_eos"] = True
        if s.endpoint == "chat":
            body["messages"] = conversation.messages(answers)
            if s.logprobs is not None:
                body |= {"logprobs": True, "top_logprobs": s.logprobs}
        else:
            body["prompt"] = conversation.completion_prompt(len(answers))
            if s.logprobs is not None:
                body["logprobs"] = s.logprobs
        return body

    async def send(self, conversation: Conversation, answers: list[str]) -> RequestRecord:
        """Turn `len(answers)` of `conversation`, streamed and timed; never raises for a
        failed request (the record says why)."""
        turn = conversation.turns[len(answers)]
        prompt = turn.prompt
        record = RequestRecord(turn=len(answers), max_tokens=turn.max_tokens)
        stream = _Stream(self.clock())
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                record.error = await self._stream(self.body(conversation, answers), stream)
        except TimeoutError:
            record.error = f"no complete answer within the {self.settings.timeout_s:g} s timeout"
        except httpx.HTTPError as e:
            record.error = _describe(e)
        except ValueError as e:  # an event that is not JSON
            record.error = f"malformed stream: {e}"
        record.e2e_s = self.clock() - stream.start
        record.success = record.error is None
        record.ttft_s = stream.stamps[0] - stream.start if stream.stamps else None
        record.itl_s = [b - a for a, b in itertools.pairwise(stream.stamps)]
        record.output_tokens = stream.output_tokens()
        record.prompt_tokens = stream.usage.get("prompt_tokens")
        if record.prompt_tokens is None and isinstance(prompt, tuple):
            record.prompt_tokens = len(prompt)
        details = stream.usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            record.cached_tokens = details["cached_tokens"]
        record.answer = "".join(stream.text)
        return record

    async def _stream(self, body: dict[str, Any], stream: _Stream) -> str | None:
        """Read the response into `stream`; the failure's message, or None."""
        async with self.http.stream("POST", self.url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return f"HTTP {response.status_code}: {_error_message(response.text)}"
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return None
                event = json.loads(data)
                if not isinstance(event, dict):
                    return f"malformed stream: an event that is not an object: {data[:200]}"
                if "error" in event:
                    return f"error event: {_error_message(data)}"
                stream.take(event, self.clock())
        return "the stream ended without data: [DONE]"


class _Stream:
    """What one response's events said so far."""

    def __init__(self, start: float):
        self.start = start
        self.stamps: list[float] = []  # arrival of each output-carrying chunk
        self.text: list[str] = []
        self.counted_tokens = 0
        self.usage: dict[str, Any] = {}

    def take(self, event: dict[str, Any], now: float) -> None:
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        choices = event.get("choices")
        carried = finished = False
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict):
                continue
            text, tokens = _choice_output(choice)
            self.text.append(text)
            if text or tokens:
                carried = True
                self.counted_tokens += tokens or 1
            finished |= choice.get("finish_reason") is not None
        if carried or (finished and not self.stamps):
            self.stamps.append(now)

    def output_tokens(self) -> int:
        completion = self.usage.get("completion_tokens")
        if isinstance(completion, int):
            return completion
        return self.counted_tokens or len(self.stamps)


def _choice_output(choice: dict[str, Any]) -> tuple[str, int]:
    """(text, tokens its logprobs name) of one streamed choice, completions or chat."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        text = delta.get("content") or delta.get("reasoning_content") or ""
    else:
        text = choice.get("text") or ""
    logprobs = choice.get("logprobs")
    tokens = 0
    if isinstance(logprobs, dict):
        listed = logprobs.get("content") if isinstance(delta, dict) else logprobs.get("tokens")
        tokens = len(listed) if isinstance(listed, list) else 0
    return (text if isinstance(text, str) else ""), tokens


def _error_message(text: str) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    try:
        payload = json.loads(text)
    except ValueError:
        return text.strip()[:300] or "(empty body)"
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    if isinstance(error, dict) and "detail" in error:
        return str(error["detail"])[:300]
    return str(error)[:300]


def _describe(error: Exception) -> str:
    reason = str(error)
    return f"{type(error).__name__}: {reason}" if reason else type(error).__name__
