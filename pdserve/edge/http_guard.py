"""What a client may make an HTTP process (router or worker) hold before its request reaches
the app: how long it may take to send a request's headers and its body, how large and how many
the headers may be, and how many connections are open at once. Torch-free: the router serves
through it too.

uvicorn bounds none of these with httptools (the parser it picks, and the one pdserve always
uses): a client sending headers, or a body, a byte at a time holds its connection (a file
descriptor) forever, and one 64 MiB header is read whole into memory.
`GuardedHttpToolsProtocol` is uvicorn's protocol with those bounds:

- header time: from the connection's start (or, on a kept-alive connection, from a request's
  first byte) to the end of its headers; past it, 408 (or, with nothing received, a plain
  close). Between requests uvicorn's own keep-alive timeout applies.
- body time: from the end of a request's headers to the end of its body (Content-Length or
  chunked); past it, 408 and the connection is closed, and the app, which may be waiting for
  the body, sees the client leave (`http.disconnect`). One deadline for the whole body, not a
  rate: a byte every few seconds keeps any per-read timer happy. A response is never cut: if
  the app has begun answering, the connection closes when the answer ends; the response's
  own time (a stream) is never bounded here.
- header size and count: over either, 431 and the connection is closed. Bytes of headers
  still incomplete are counted as they arrive, so a connection holds at most the limit plus
  one read before it is refused.
- connections: at the cap, a new connection closes the oldest one that has no request in
  progress (idle, or still sending its headers or its body: what slowloris holds; until its
  body has arrived a request has cost its app nothing), so probes and real clients still get
  in; only when every connection has a request in progress is the new one refused with 503.
  The cap stays well under the open-file limit (`connection_cap`), so the router's own legs
  to its workers always have file descriptors.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import resource
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from pdserve.edge.api_errors import error_body
from pdserve.protocol.log_limit import RateLimitedLog

logger = logging.getLogger(__name__)

# NOTE: file descriptors per client connection a router may need besides it: a prefill and
# a decode leg, and pooled connections to both.
FDS_PER_CONNECTION = 4
MAX_AUTO_CONNECTIONS = 16384
# NOTE: a refusal is an error in OpenAI's shape like every other error pdserve answers;
# 503's code is the failure kind a router retries elsewhere (protocol/failures.py).
REFUSAL_CODES = {
    408: "request_timeout",
    431: "request_header_fields_too_large",
    503: "unavailable",
}


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_header_bytes: int
    max_header_count: int
    max_connections: int


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (what a server may hold open); the limit
    in force after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # NOTE: some hard limits (RLIM_INFINITY on macOS) cannot be the soft one
    return soft


def connection_cap(requested: int, open_file_limit: int) -> int:
    """The connection cap: `requested` (0: automatic), never more than what leaves each
    connection's legs their file descriptors within `open_file_limit`."""
    most = max(open_file_limit // FDS_PER_CONNECTION, 1)
    if requested == 0:
        return min(most, MAX_AUTO_CONNECTIONS)
    if requested > most:
        logger.warning(
            "--max-connections %d lowered to %d: the open-file limit is %d (raise it with "
            "`ulimit -n`)",
            requested,
            most,
            open_file_limit,
        )
        return most
    return requested


class WaitingConnections:
    """One server's connections that have no request in progress, longest waiting first."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.connections: OrderedDict[GuardedHttpToolsProtocol, None] = OrderedDict()
        self.refusals = RateLimitedLog(logger, per_second=0.2, burst=3)

    def wait(self, connection: GuardedHttpToolsProtocol) -> None:
        self.connections[connection] = None
        self.connections.move_to_end(connection)

    def done(self, connection: GuardedHttpToolsProtocol) -> None:
        self.connections.pop(connection, None)

    def longest(self, besides: GuardedHttpToolsProtocol) -> GuardedHttpToolsProtocol | None:
        for connection in self.connections:
            if connection is not besides:
                return connection
        return None


def protocol_factory(limits: ConnectionLimits) -> functools.partial:
    """What uvicorn.Config takes as `http`: the guarded protocol, sharing one server's
    waiting connections."""
    return functools.partial(GuardedHttpToolsProtocol, waiting=WaitingConnections(limits))


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds in this module's docstring."""

    def __init__(self, *args, waiting: WaitingConnections, **kwargs):
        super().__init__(*args, **kwargs)
        self.waiting = waiting
        self.limits = waiting.limits
        # NOTE: one deadline at a time: the headers' (connection made or message begun to
        # headers complete), then the body's (to message complete).
        self.deadline: asyncio.TimerHandle | None = None
        self.awaiting_headers = True
        # NOTE: the request's headers so far, as the parser gave them (name and value) and
        # as they arrived while incomplete; either over the limit is a 431.
        self.header_bytes = 0
        self.header_bytes_read = 0
        self.header_count = 0
        self.refused = False

    # ---- the connection -------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.waiting.wait(self)
        self._arm_deadline(self.limits.header_timeout_s, self._headers_late)
        if len(self.connections) <= self.limits.max_connections:
            return
        oldest = self.waiting.longest(besides=self)
        if oldest is not None:
            oldest.refuse_waiting()
        else:
            self.waiting.refusals.warning(
                "connection refused: %d connections, each with a request in progress "
                "(--max-connections)",
                len(self.connections) - 1,
                key="full",
            )
            self.refuse(503, "too many connections")

    def connection_lost(self, exc: Exception | None) -> None:
        self.waiting.done(self)
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        super().data_received(data)
        if self.awaiting_headers and not self.refused and not self.transport.is_closing():
            # NOTE: what the parser holds of headers not yet complete; may count the end of
            # the previous request's bytes in the same read too, at most one read more.
            self.header_bytes_read += len(data)
            self._check_header_bytes()

    # ---- parser callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.refused:
            return
        super().on_message_begin()
        self.awaiting_headers = True
        self.header_bytes = self.header_bytes_read = 0
        self.header_count = 0
        if self.deadline is None:
            self._arm_deadline(self.limits.header_timeout_s, self._headers_late)

    def on_url(self, url: bytes) -> None:
        if self.refused:
            return
        super().on_url(url)
        self.header_bytes += len(url)
        self._check_header_bytes()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.refused:
            return
        self.header_count += 1
        if self.header_count > self.limits.max_header_count:
            self.refuse(431, f"more than {self.limits.max_header_count} request headers")
            return
        self.header_bytes += len(name) + len(value)
        if self._check_header_bytes():
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.refused:
            return
        self.awaiting_headers = False
        # NOTE: still waiting (evictable) until its body has arrived; a request without one
        # completes its message at once.
        self._arm_deadline(self.limits.body_timeout_s, self._body_late)
        super().on_headers_complete()

    def handle_websocket_upgrade(self) -> None:
        self._cancel_deadline()  # NOTE: the connection is the websocket protocol's now
        self.waiting.done(self)
        super().handle_websocket_upgrade()

    def on_body(self, body: bytes) -> None:
        if not self.refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self.refused:
            return
        self._cancel_deadline()
        if self.cycle.response_complete:
            # NOTE: answered before its body ended (a 401, say), and idle again: the body's
            # bytes cancelled uvicorn's keep-alive timer, armed at the answer.
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
        else:
            self.waiting.done(self)
        super().on_message_complete()

    def on_response_complete(self) -> None:
        idle = not self.pipeline  # NOTE: else the next request, already read, starts now
        super().on_response_complete()
        if idle and not self.transport.is_closing():
            # NOTE: idle (under uvicorn's keep-alive timeout) until the next request's first
            # byte starts its header time.
            self.header_bytes = self.header_bytes_read = 0
            self.waiting.wait(self)

    # ---- refusing ------------------------------------------------------------------------

    def refuse_waiting(self) -> None:
        """Close a connection that has no request in progress (to make room for a new one,
        or when its headers or body took too long): 408 when it had sent part of a request
        not yet answered."""
        if not self.awaiting_headers:
            self._refuse_body()
        elif self.header_bytes or self.header_bytes_read:
            self.refuse(408, "request headers not received in time")
        else:
            self._close()

    def refuse(self, status: int, message: str) -> None:
        """Answer `status` and close the connection; its request never reaches the app."""
        if status != 503:
            self.waiting.refusals.info("%s: %s", status, message, key=status)
        content = json.dumps(error_body(status, message, code=REFUSAL_CODES[status])).encode()
        self.transport.write(
            b"".join(
                [
                    STATUS_LINE[status],
                    *(b"%s: %s\r\n" % header for header in self.server_state.default_headers),
                    b"content-type: application/json\r\n",
                    b"content-length: %d\r\n" % len(content),
                    b"connection: close\r\n\r\n",
                    content,
                ]
            )
        )
        self._close()

    def _refuse_body(self) -> None:
        if not self.cycle.response_started:
            self.refuse(408, "request body not received in time")
        elif self.cycle.response_complete:
            self._close()  # NOTE: answered already (a 401, say); the rest of the body is moot
        else:
            # NOTE: an answer in progress is never cut: uvicorn closes when it ends, and
            # until then it is a request in progress.
            self.cycle.keep_alive = False
            self.waiting.done(self)

    def _close(self) -> None:
        self.refused = True
        self._cancel_deadline()
        self.waiting.done(self)
        self.transport.close()

    def _check_header_bytes(self) -> bool:
        if max(self.header_bytes, self.header_bytes_read) <= self.limits.max_header_bytes:
            return True
        self.refuse(431, f"request headers over {self.limits.max_header_bytes} bytes")
        return False

    def _arm_deadline(self, seconds: float, late: Callable[[], None]) -> None:
        self._cancel_deadline()
        self.deadline = self.loop.call_later(seconds, late)

    def _cancel_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _headers_late(self) -> None:
        self.deadline = None
        if not self.refused and not self.transport.is_closing():
            self.refuse_waiting()

    def _body_late(self) -> None:
        self.deadline = None
        if not self.refused and not self.transport.is_closing():
            self._refuse_body()
