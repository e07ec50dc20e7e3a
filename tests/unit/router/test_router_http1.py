"""The router's HTTP/1.1 client for legs (router/http1.py) against scripted servers on
loopback: framing, keep-alive reuse, stale connections, and the errors a broken worker gives."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Awaitable, Callable

import httpx
import pytest

from pdserve.router.http1 import Dechunker, Http1Pool

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head + await reader.readexactly(length)


def _run(script: Script, client: Callable[[Http1Pool, str], Awaitable]):
    """Serve `script` (once per connection) on loopback and run `client(pool, url)`; returns
    its result and how many connections the server accepted."""

    async def main():
        connections = []

        async def serve(reader, writer):
            connections.append(writer)
            try:
                await script(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Http1Pool(connect_timeout_s=5, write_timeout_s=5, dead_worker_timeout_s=15)
        try:
            async with server:
                result = await client(pool, f"http://127.0.0.1:{port}/v1/completions")
        finally:
            await pool.aclose()
        return result, len(connections)

    return asyncio.run(main())


async def _keep_answering(reader, writer, answer: bytes = b'{"ok": true}') -> None:
    while True:
        await _read_request(reader)
        writer.write(OK_HEAD + b"content-length: %d\r\n\r\n%s" % (len(answer), answer))
        await writer.drain()


async def _post(pool: Http1Pool, url: str) -> bytes:
    response = await pool.post(url, b'{"prompt": "hi"}', {"X-Request-Id": "r1"})
    body = await response.aread()
    await response.aclose()
    return body


def test_answers_with_a_length_are_read_whole_on_one_kept_alive_connection():
    async def three(pool, url):
        return [await _post(pool, url) for _ in range(3)]

    bodies, connections = _run(_keep_answering, three)
    assert bodies == [b'{"ok": true}'] * 3
    assert connections == 1


def test_the_request_goes_out_whole_with_its_headers():
    seen = []

    async def record(reader, writer):
        seen.append(await _read_request(reader))
        writer.write(OK_HEAD + b"content-length: 2\r\n\r\n{}")

    _run(record, _post)
    head, body = seen[0].split(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/completions HTTP/1.1"
    assert {b"X-Request-Id: r1", b"Content-Length: 16"} <= set(lines)
    assert body == b'{"prompt": "hi"}'


def test_chunks_come_as_they_arrive_and_those_that_came_together_come_together():
    events = asyncio.Queue()

    async def stream(reader, writer):
        await _read_request(reader)
        writer.write(OK_HEAD + b"transfer-encoding: chunked\r\n\r\n" + b"3\r\none\r\n")
        await writer.drain()
        await events.get()  # NOTE: the client has the first chunk
        writer.write(b"3\r\ntwo\r\n5;x=y\r\nthree\r\n0\r\nTrailer: t\r\n\r\n")
        await writer.drain()

    async def read(pool, url):
        response = await pool.post(url, b"{}", {})
        chunks = []
        async for chunk in response.stream:
            chunks.append(chunk)
            events.put_nowait(None)
        await response.aclose()
        return chunks

    chunks, _ = _run(stream, read)
    assert chunks == [b"one", b"twothree"]


def test_a_stream_that_came_whole_is_complete_with_its_last_data_and_its_connection_free():
    """The relay sends a stream's last data with the response's end once the answer is
    complete, and reads no further: the connection must be back in the pool by then."""

    async def stream_whole(reader, writer):
        while True:
            await _read_request(reader)
            writer.write(OK_HEAD + b"transfer-encoding: chunked\r\n\r\n3\r\none\r\n0\r\n\r\n")
            await writer.drain()

    async def twice(pool, url):
        complete = []
        for _ in range(2):
            response = await pool.post(url, b"{}", {})
            chunk = await anext(response.stream)
            complete.append((chunk, response.complete))
            await response.aclose()  # NOTE: without reading on: the relay stops there
        return complete

    complete, connections = _run(stream_whole, twice)
    assert complete == [(b"one", True)] * 2
    assert connections == 1


def test_a_stream_is_not_complete_before_its_last_chunk():
    events = asyncio.Queue()

    async def stream(reader, writer):
        await _read_request(reader)
        writer.write(OK_HEAD + b"transfer-encoding: chunked\r\n\r\n3\r\none\r\n")
        await writer.drain()
        await events.get()
        writer.write(b"3\r\ntwo\r\n0\r\n\r\n")
        await writer.drain()

    async def read(pool, url):
        response = await pool.post(url, b"{}", {})
        seen = []
        async for chunk in response.stream:
            seen.append((chunk, response.complete))
            events.put_nowait(None)
        await response.aclose()
        return seen

    seen, _ = _run(stream, read)
    assert seen == [(b"one", False), (b"two", True)]


def test_chunked_bodies_come_out_the_same_however_their_bytes_arrive():
    body = b"3\r\none\r\n5;ext=1\r\nthree\r\n0\r\nTrailer: t\r\n\r\n"
    for size in (1, 2, 3, 7, len(body)):
        chunks, data = Dechunker(), b""
        for at in range(0, len(body), size):
            assert not chunks.done
            data += chunks.feed(body[at : at + size])
        assert (data, chunks.done) == (b"onethree", True), size
    with pytest.raises(httpx.RemoteProtocolError, match="bad chunk size"):
        Dechunker().feed(b"zz\r\n")


def test_an_answer_without_length_ends_with_the_connection_which_is_not_reused():
    async def until_close(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nall of it")
        await writer.drain()

    async def twice(pool, url):
        return [await _post(pool, url) for _ in range(2)]

    bodies, connections = _run(until_close, twice)
    assert bodies == [b"all of it"] * 2 and connections == 2


def test_an_answer_left_unread_closes_its_connection():
    async def stream_slowly(reader, writer):
        await _read_request(reader)
        writer.write(OK_HEAD + b"transfer-encoding: chunked\r\n\r\n3\r\none\r\n")
        await writer.drain()
        await reader.read()  # NOTE: until the client closes the connection
        raise ConnectionError

    async def abandon(pool, url):
        response = await pool.post(url, b"{}", {})
        await anext(response.stream)
        await response.aclose()
        return pool._idle

    idle, _ = _run(stream_slowly, abandon)
    assert not any(idle.values())


def test_a_kept_alive_connection_the_worker_closed_is_replaced_unnoticed():
    async def one_answer_per_connection(reader, writer):
        await _read_request(reader)
        writer.write(OK_HEAD + b"content-length: 2\r\n\r\n{}")
        await writer.drain()
        await reader.read(1)  # NOTE: the next request arrives and is dropped unanswered

    async def twice(pool, url):
        first = await _post(pool, url)
        # NOTE: the connection still looks usable: the request goes out on it first.
        return first, await _post(pool, url)

    bodies, connections = _run(one_answer_per_connection, twice)
    assert bodies == (b"{}", b"{}") and connections == 2


def test_a_new_connection_closed_unanswered_is_a_protocol_error():
    async def hang_up(reader, writer):
        await _read_request(reader)

    with pytest.raises(httpx.RemoteProtocolError, match="closed the connection unanswered"):
        _run(hang_up, _post)


def test_a_stream_cut_mid_chunk_is_a_protocol_error():
    async def cut(reader, writer):
        await _read_request(reader)
        writer.write(OK_HEAD + b"transfer-encoding: chunked\r\n\r\n9\r\nhalf")
        await writer.drain()

    with pytest.raises(httpx.RemoteProtocolError, match="before its answer was complete"):
        _run(cut, _post)


@pytest.mark.parametrize(
    "answer",
    [b"SSH-2.0-OpenSSH\r\n\r\n", OK_HEAD + b"transfer-encoding: chunked\r\n\r\nzz\r\n"],
)
def test_what_is_not_http_is_a_protocol_error(answer):
    async def garble(reader, writer):
        await _read_request(reader)
        writer.write(answer)
        await writer.drain()

    with pytest.raises(httpx.RemoteProtocolError):
        _run(garble, _post)


def test_nothing_listening_is_a_connect_error():
    async def nowhere():
        pool = Http1Pool(connect_timeout_s=5, write_timeout_s=5, dead_worker_timeout_s=15)
        await pool.post("http://127.0.0.1:9/generate", b"{}", {})

    with pytest.raises(httpx.ConnectError):
        asyncio.run(nowhere())


def test_a_line_break_in_a_header_never_reaches_the_worker():
    async def nothing(reader, writer):
        pass

    async def smuggle(pool, url):
        await pool.post(url, b"{}", {"X-Request-Id": "a\r\nX-Evil: 1"})

    with pytest.raises(ValueError, match="line break"):
        _run(nothing, smuggle)


def test_a_read_the_kernel_timed_out_is_a_broken_connection(monkeypatch):
    """A worker that fell silent mid-answer (host down, cable cut): the dead-peer socket
    options end the read with ETIMEDOUT, a TimeoutError. That is the worker failing (a
    ReadError, answered as such), not the request's own deadline."""

    async def stall(reader, writer):
        await _read_request(reader)
        writer.write(OK_HEAD + b"content-length: 100\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(30)

    async def read_body(pool: Http1Pool, url: str) -> None:
        response = await pool.post(url, b'{"prompt": "hi"}', {})
        timed_out = TimeoutError(errno.ETIMEDOUT, os.strerror(errno.ETIMEDOUT))

        async def read(self, n=-1):
            raise timed_out

        monkeypatch.setattr(asyncio.StreamReader, "read", read)
        async for _ in response.stream:
            pass

    with pytest.raises(httpx.ReadError, match="TimeoutError"):
        _run(stall, read_body)
