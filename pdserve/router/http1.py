"""A small HTTP/1.1 client for the router's legs: POST a JSON body in one write, read the
status line and headers, then the body as it arrives (Content-Length, chunked, or until the
worker closes). Torch-free.

Why not httpx here: a leg is the router's hot path, and httpx's general machinery (its
client, httpcore's pool, h11's state machine, anyio) cost the router more CPU than all its
other work on a request (benchmarks/router_overhead.py; benchmarks/RESULTS.md). This client
does the one exchange a leg is: no redirects, cookies, auth flows or content decoding (no
Accept-Encoding goes out, so the answer comes as the worker wrote it, to be passed on byte for
byte). httpx stays for everything else (health checks, model info) and for tests' fake
transports (`legs.HttpxLegClient`).

Errors are httpx's exception types, so the router has one vocabulary for a worker it could not
talk to: ConnectError and ConnectTimeout, WriteError and WriteTimeout, RemoteProtocolError
(the worker closed the connection before a complete answer, or sent something that is not
HTTP/1.1), ReadError (the connection broke).

Connections are kept alive per worker and reused. One that fails before the answer's first
byte after it had served a request (the worker closed it while idle: its keep-alive timeout,
a restart) is no failure of the worker: the request goes once more on a new connection.
Sockets get the dead-peer options (`transport.dead_peer_socket_options`).

A worker that stops answering while its host still does (SIGSTOP, a wedged event loop: its
kernel keeps the connections up, so the dead-peer options never fire) has its connections cut
(`cut_worker`, when its health checks time out): every leg on them fails at once with
ReadError, which the router retries elsewhere while nothing was relayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx

from pdserve.router.transport import dead_peer_socket_options

MAX_HEAD_BYTES = 64 << 10  # the status line and headers of an answer
MAX_IDLE_PER_WORKER = 256
MAX_CHUNK_LINE_BYTES = 1024
_FORBIDDEN_IN_HEADERS = re.compile(r"[\r\n\0]")
# NOTE: OSError, not only ConnectionError: the dead-peer socket options end a read from a
# silent worker with ETIMEDOUT, a TimeoutError (an OSError), which is the connection breaking.
_BROKEN = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError)


class _Stale(Exception):
    """A reused connection failed before the answer's first byte."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, open_ones: set):
        self.reader = reader
        self.writer = writer
        self.served = 0  # answers read whole on it
        self.cut = False  # by `Http1Pool.cut_worker`: its worker stopped answering
        self._open_ones = open_ones  # NOTE: its worker's open connections, itself among them
        open_ones.add(self)

    @property
    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.transport.is_closing()

    def close(self) -> None:
        self._open_ones.discard(self)
        self.writer.transport.abort()  # NOTE: a half-read answer must not linger


class Http1Pool:
    """Connections to the workers, kept alive per (scheme, host, port)."""

    def __init__(
        self, connect_timeout_s: float, write_timeout_s: float, dead_worker_timeout_s: float
    ):
        self.connect_timeout_s = connect_timeout_s
        self.write_timeout_s = write_timeout_s
        self.socket_options = dead_peer_socket_options(dead_worker_timeout_s)
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open: dict[tuple[str, str, int], set[_Connection]] = {}  # idle or in use
        self._ssl: ssl.SSLContext | None = None

    async def post(self, url: str, content: bytes, headers: dict[str, str]) -> Http1Response:
        """The worker's answer to a POST of `content` (JSON), its body still to read."""
        scheme, host, port, target = _split(url)
        key = (scheme, host, port)
        request = _request_head(host, port, target, len(content), headers) + content
        connection = self._take_idle(key)
        if connection is not None:
            try:
                return await self._exchange(key, connection, request)
            except _Stale:
                pass  # NOTE: the worker closed it while idle: once more, on a new one
        return await self._exchange(key, await self._connect(key), request)

    def cut_worker(self, url: str) -> int:
        """Close every connection to the worker at `url`, idle or in use (it stopped
        answering): the legs reading from them fail with ReadError. How many were open."""
        scheme, host, port, _ = _split(url)
        open_ones = self._open.get((scheme, host, port), set())
        count = len(open_ones)
        for connection in list(open_ones):
            connection.cut = True
            connection.close()
        return count

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()

    def _take_idle(self, key) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            if connection.usable:
                return connection
            connection.close()
        return None

    def _put_idle(self, key, connection: _Connection) -> None:
        idle = self._idle.setdefault(key, [])
        if connection.usable and len(idle) < MAX_IDLE_PER_WORKER:
            idle.append(connection)
        else:
            connection.close()

    async def _connect(self, key) -> _Connection:
        scheme, host, port = key
        context = self._tls() if scheme == "https" else None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=context, limit=MAX_HEAD_BYTES
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection within {self.connect_timeout_s} s") from None
        except OSError as e:
            raise httpx.ConnectError(str(e) or type(e).__name__) from None
        sock = writer.get_extra_info("socket")
        for level, name, value in self.socket_options:
            sock.setsockopt(level, name, value)
        return _Connection(reader, writer, self._open.setdefault(key, set()))

    def _tls(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        return self._ssl

    async def _exchange(self, key, connection: _Connection, request: bytes) -> Http1Response:
        """Send the request and read the answer's head. Raises _Stale when a reused
        connection fails before any byte of answer."""
        try:
            connection.writer.write(request)
            if connection.writer.transport.get_write_buffer_size():
                try:
                    async with asyncio.timeout(self.write_timeout_s):
                        await connection.writer.drain()
                except TimeoutError:
                    connection.close()
                    message = f"request not sent within {self.write_timeout_s} s"
                    raise httpx.WriteTimeout(message) from None
            status, headers = await _read_head(connection.reader)
            return Http1Response(self, key, connection, status, headers)
        except (OSError, asyncio.IncompleteReadError) as e:  # NOTE: see _BROKEN
            connection.close()
            if connection.cut:
                raise httpx.ReadError("the worker stopped answering (health checks)") from None
            if connection.served and not getattr(e, "partial", b""):
                raise _Stale() from None
            if isinstance(e, OSError):
                raise httpx.ReadError(f"{type(e).__name__}: {e}") from None
            raise httpx.RemoteProtocolError("the worker closed the connection unanswered") from None
        except asyncio.LimitOverrunError:
            connection.close()
            raise httpx.RemoteProtocolError(f"answer head over {MAX_HEAD_BYTES} bytes") from None
        except BaseException:
            connection.close()
            raise


class Http1Response:
    """A worker's answer: `status_code`; the body as it arrives (`stream`, an async iterator
    of the worker's chunks, read once) or whole (`aread`); `aclose` when done with it (the
    connection goes back to the pool if the body was read to its end, else it is closed)."""

    def __init__(self, pool: Http1Pool, key, connection: _Connection, status: int, headers):
        self.status_code = status
        self.headers = headers
        self._pool = pool
        self._key = key
        self._connection: _Connection | None = connection
        close = headers.get("connection", "").lower() == "close"
        if status in (204, 304):
            self._framing, self._length = "length", 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._framing, self._length = "chunked", None
        elif "content-length" in headers:
            try:
                self._framing, self._length = "length", int(headers["content-length"])
            except ValueError:
                raise httpx.RemoteProtocolError("the worker sent a bad Content-Length") from None
        else:
            self._framing, self._length, close = "close", None, True
        self._keep_alive = not close
        self.complete = False  # the body was read to its end (the connection is let go)
        self._stream: AsyncIterator[bytes] | None = None

    @property
    def stream(self) -> AsyncIterator[bytes]:
        # NOTE: made on first use: an async generator costs the event loop's bookkeeping
        # once it is iterated or closed, which an answer read whole (`aread`) does without.
        if self._stream is None:
            self._stream = self._body()
        return self._stream

    async def aread(self) -> bytes:
        if self._framing != "length" or self._stream is not None or self._connection is None:
            return b"".join([chunk async for chunk in self.stream])
        with self._reading():
            body = await self._connection.reader.readexactly(self._length)
        self._finish()
        return body

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
        self._drop()

    def _finish(self) -> None:
        """The body was read to its end: the connection serves again, or closes."""
        if self.complete or self._connection is None:
            return
        self.complete = True
        connection, self._connection = self._connection, None
        if self._keep_alive:
            connection.served += 1
            self._pool._put_idle(self._key, connection)
        else:
            connection.close()

    def _drop(self) -> None:
        """Close the connection of an answer not read to its end (it cannot serve again)."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    @contextlib.contextmanager
    def _reading(self):
        """Around a read of the body: a broken connection (or one the worker closed) is an
        httpx error; whatever ends the read early closes the connection."""
        try:
            yield
        except _BROKEN as e:
            cut = self._connection is not None and self._connection.cut
            self._drop()
            if cut:
                raise httpx.ReadError("the worker stopped answering (health checks)") from None
            if isinstance(e, OSError):
                raise httpx.ReadError(f"{type(e).__name__}: {e}") from None
            raise httpx.RemoteProtocolError(
                "the worker closed the connection before its answer was complete"
            ) from None
        except BaseException:
            self._drop()
            raise

    async def _body(self) -> AsyncIterator[bytes]:
        if self._connection is None:
            return  # NOTE: read whole already, or closed
        reader = self._connection.reader
        with self._reading():
            if self._framing == "chunked":
                chunks = Dechunker()
                while not chunks.done:
                    data = await reader.read(1 << 16)
                    if not data:
                        raise asyncio.IncompleteReadError(b"", None)
                    data = chunks.feed(data)
                    if chunks.done:
                        self._finish()  # NOTE: before the last data: its reader may stop there
                    if data:
                        yield data
            elif self._framing == "length":
                left = self._length
                while left > 0:
                    data = await reader.read(min(left, 1 << 16))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(data)
                    if left == 0:
                        self._finish()
                    yield data
            else:
                while data := await reader.read(1 << 16):
                    yield data
        self._finish()


class Dechunker:
    """A chunked body's data from its bytes as they arrive, without I/O: `feed` returns the
    data of the chunks that arrived whole, joined (several of a stream's events that came
    together go on together: one write for the client instead of one each, and no delay for
    any of them); `done` once the last chunk came."""

    def __init__(self) -> None:
        self.done = False
        self._rest = b""  # NOTE: bytes not parsed yet

    def feed(self, data: bytes) -> bytes:
        buffer, at, pieces = self._rest + data, 0, []
        while (line_end := buffer.find(b"\r\n", at)) >= 0:
            try:
                size = int(buffer[at:line_end].partition(b";")[0], 16)
            except ValueError:
                raise httpx.RemoteProtocolError(
                    f"bad chunk size line: {buffer[at:line_end][:40]!r}"
                ) from None
            if size == 0:
                # NOTE: the last chunk, then trailers (which nothing here needs), then a
                # blank line.
                self.done = buffer.find(b"\r\n\r\n", line_end) >= 0
                break
            start, end = line_end + 2, line_end + 2 + size
            if len(buffer) < end + 2:
                break
            pieces.append(buffer[start:end])
            at = end + 2
        self._rest = buffer[at:]
        if b"\r\n" not in self._rest and len(self._rest) > MAX_CHUNK_LINE_BYTES:
            raise httpx.RemoteProtocolError("a chunk size line runs on without an end")
        return b"".join(pieces)


@functools.lru_cache(maxsize=1024)  # NOTE: a leg's URL is a worker's and an endpoint
def _split(url: str) -> tuple[str, str, int, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return parts.scheme, parts.hostname, port, target


def _request_head(host: str, port: int, target: str, length: int, headers) -> bytes:
    host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    fields = [f"{name}: {value}" for name, value in headers.items()]
    # NOTE: the client's headers reach here through the HTTP server, which refuses line
    # breaks in them; checked again (all at once), as one would split a worker's request
    # in two.
    if _FORBIDDEN_IN_HEADERS.search("".join(fields)):
        name = next(n for n, v in headers.items() if _FORBIDDEN_IN_HEADERS.search(n + v))
        raise ValueError(f"header {name!r} holds a line break or NUL")
    lines = [f"POST {target} HTTP/1.1", f"Host: {host_header}", f"Content-Length: {length}"]
    return ("\r\n".join(lines + fields) + "\r\n\r\n").encode("latin-1")


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The answer's status and headers (lower-case names), past any 1xx interim answer."""
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise httpx.RemoteProtocolError(f"not an HTTP/1.1 answer: {status_line[:80]!r}")
        status = int(rest[:3])
        if not 100 <= status < 200:
            break
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if version == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
        headers["connection"] = "close"
    return status, headers
