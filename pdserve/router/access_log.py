"""One line per request to the router's generation endpoints, at INFO on the
`pdserve.router.access` logger, written when the request ends: its last byte sent, the client
gone, or the router failed. Torch-free. For example:

    request 3f2a... POST /v1/completions 200 prefill=http://10.0.0.5:30001
    decode=http://10.0.0.6:30002 ttft=0.012s tokens=32 duration=0.180s   (one line)

The fields, in order:
- the request id: the client's `X-Request-Id`, else the one the router made (both legs and
  the response carry it);
- method and path;
- the status sent, and a word where the request did not end as that status says:
  `stream-error=STATUS`, a stream that had started ended with an error event (STATUS: the
  error's; the router's own, or a worker's found in the stream's last two chunks);
  `client-disconnected`, the client left (499 when nothing had been sent yet, else the
  status already sent); `internal-error`, a bug in the router (its traceback is logged);
- `rooms=N` for a request split into several parts (a prompt list, n > 1; the field keeps
  its first name, which operators grep); the workers,
  `prefill=URL decode=URL`, of the last pair each part used (several distinct ones
  comma-separated), `-` for a request refused before any pair was chosen; `worker=URL` in
  colocated mode; `retries=N` when parts were retried on a new pair (or worker);
- `ttft`: seconds from arrival to the first byte of a stream sent to the client; `-` for an
  answer that is not streamed (it goes out whole: `duration` says when);
- `tokens`: output tokens, the sum over parts of the `completion_tokens` (`usage`, or SGLang's
  `meta_info`) that the last bytes of each part's answer carry: a byte search of a whole
  answer, or of a stream's last two chunks (its usage chunk, or /generate's last event), so
  that streams pay no JSON parsing for it; `-` when a part's did not show one (a stream
  without `stream_options.include_usage`, a failure, a client that left);
- `duration`: seconds from arrival to the end.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.edge.access_lines import write_line
from pdserve.edge.error_handlers import error_response
from pdserve.edge.request_ids import RequestIdError, request_id_of
from pdserve.router.errors import worker_outcome
from pdserve.router.pairing import Pair
from pdserve.router.workers import Worker

logger = logging.getLogger("pdserve.router.access")

_TOKENS_KEY = b'"completion_tokens":'  # NOTE: inside a JSON string its quotes are escaped
_INTEGER = re.compile(rb"\s*(\d+)")
_ERROR_EVENT = b'data: {"error":'  # NOTE: how workers write one (json.dumps)


@dataclass
class AccessRecord:
    """A request's access line in the making: the proxy notes its parts, routes, retries and
    answer bytes; `AccessLog` what was sent to the client, and writes the line."""

    request_id: str
    method: str = "POST"
    path: str = ""
    started: float = field(default_factory=time.monotonic)
    colocated: bool = False  # the router's mode: how its workers are named
    parts: int = 1  # fanout's: one per prompt and choice
    routes: dict[int, Pair | Worker] = field(default_factory=dict)  # part -> the last route
    retries: int = 0
    stream_error: str | None = None  # the status of the error event a started stream ended with
    status: int | None = None  # sent to the client
    streamed: bool = False
    first_byte_at: float | None = None
    complete: bool = False  # the last byte was sent
    _tails: dict[int, tuple[bytes, bytes]] = field(default_factory=dict, repr=False)

    def routed(self, part: int, route: Pair | Worker) -> None:
        """Part `part` was sent to `route`: a prefill/decode pair, or a colocated worker."""
        self.routes[part] = route

    def saw(self, part: int, data: bytes) -> None:
        """Bytes that part `part`'s decode worker answered: a stream's chunk, or a whole
        answer. Only the last two are kept, for `tokens`."""
        self._tails[part] = (self._tails.get(part, (b"", b""))[1], data)

    def sent(self, message: Message) -> None:
        """An ASGI message that went to the client."""
        if message["type"] == "http.response.start":
            self.status = message["status"]
            content_type = header(message.get("headers", []), b"content-type") or ""
            self.streamed = content_type.startswith("text/event-stream")
        elif message["type"] == "http.response.body":
            if self.first_byte_at is None and message.get("body"):
                self.first_byte_at = time.monotonic()
            self.complete = not message.get("more_body", False)

    def tokens(self) -> int | None:
        counts = [last_completion_tokens(a + b) for a, b in self._tails.values()]
        if len(counts) < self.parts or None in counts:
            return None
        return sum(counts)

    def line(self, failure: str | None = None) -> str:
        """failure: `client-disconnected` or `internal-error` when the app raised it."""
        status = self.status or (500 if failure == "internal-error" else 499)
        if failure is None and (not self.complete or status == 499):
            failure = "client-disconnected"
        stream_error = self.stream_error or self._worker_stream_error()
        if failure is None and stream_error is not None:
            failure = f"stream-error={stream_error}"
        ttft = "-"
        if self.streamed and self.first_byte_at is not None:
            ttft = f"{self.first_byte_at - self.started:.3f}s"
        tokens = self.tokens()
        fields = [
            f"request {self.request_id} {self.method} {self.path} {status}",
            failure,
            f"rooms={self.parts}" if self.parts > 1 else None,
            self._workers(),
            f"retries={self.retries}" if self.retries else None,
            f"ttft={ttft}",
            f"tokens={'-' if tokens is None else tokens}",
            f"duration={time.monotonic() - self.started:.3f}s",
        ]
        return " ".join(f for f in fields if f)

    def _worker_stream_error(self) -> str | None:
        """The status of the error event a worker ended a part's stream with, if one did."""
        if not self.streamed:
            return None
        for a, b in self._tails.values():
            tail = a + b
            at = tail.rfind(_ERROR_EVENT)
            if at >= 0:
                event = tail[at + len(b"data:") :].split(b"\n\n", 1)[0]
                try:
                    return str(worker_outcome(json.loads(event)["error"]).status)
                except (ValueError, KeyError, TypeError):
                    return "503"  # NOTE: what worker_outcome makes of an event it cannot read
        return None

    def _workers(self) -> str:
        routes = [self.routes[part] for part in sorted(self.routes)]
        if self.colocated:
            workers = dict.fromkeys(w.url for w in routes if isinstance(w, Worker))
            return f"worker={','.join(workers) or '-'}"
        pairs = [r for r in routes if isinstance(r, Pair)]
        prefill = dict.fromkeys(p.prefill.url for p in pairs)  # NOTE: distinct, in order
        decode = dict.fromkeys(p.decode.url for p in pairs)
        return f"prefill={','.join(prefill) or '-'} decode={','.join(decode) or '-'}"


def header(raw: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of header `name` (lower case) in ASGI's raw headers, if any."""
    for key, value in raw:
        if key == name:
            return value.decode("latin-1")
    return None


def last_completion_tokens(answer: bytes) -> int | None:
    """The last `"completion_tokens": N` in a worker's answer bytes, if any."""
    at = answer.rfind(_TOKENS_KEY)
    found = _INTEGER.match(answer, at + len(_TOKENS_KEY)) if at >= 0 else None
    return int(found.group(1)) if found else None


class AccessLog:
    """ASGI middleware: for a request to one of `paths`, an AccessRecord at
    `request.state.access` for the handler to fill in, and its line once the request ends.
    Outside every other middleware, so that refusals (401) get their line too."""

    def __init__(self, app: ASGIApp, paths: set[str], colocated: bool = False):
        self.app = app
        self.paths = paths
        self.colocated = colocated

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        try:
            request_id = request_id_of(scope["headers"])
        except RequestIdError as e:  # NOTE: before it reaches a log line or a worker
            await error_response(400, str(e), "invalid_request_id")(scope, receive, send)
            return
        record = AccessRecord(request_id, scope["method"], scope["path"], colocated=self.colocated)
        scope.setdefault("state", {})["access"] = record

        async def send_and_note(message: Message) -> None:
            await send(message)
            record.sent(message)

        failure = None
        try:
            await self.app(scope, receive, send_and_note)
        except ClientDisconnect:
            failure = "client-disconnected"
            raise
        except Exception:
            failure = "internal-error"
            raise
        finally:
            if logger.isEnabledFor(logging.INFO):
                write_line(logger, logging.INFO, record.line(failure))
