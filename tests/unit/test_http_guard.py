"""The bounds every pdserve HTTP process serves with (protocol/http_guard.py), against a real
uvicorn server built from the Config that commands/common.py builds for router and workers:
slow headers (slowloris), header floods, and the connection cap."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import pytest
import uvicorn

from pdserve.commands.common import uvicorn_config
from pdserve.protocol.http_guard import FDS_PER_CONNECTION, connection_cap
from pdserve.protocol.http_settings import HttpSettings

READ_DEADLINE_S = 10.0


async def app(scope, receive, send):
    """200 "ok" at once; /hold answers once `release` is set (a request in progress)."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/hold":
        holding.append(scope)
    while scope["path"] == "/hold" and not release.is_set():
        await asyncio.sleep(0.01)
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


release = threading.Event()
holding: list[dict] = []


@contextlib.contextmanager
def serving(**limits):
    settings = HttpSettings(port=0, **limits)
    config = uvicorn_config(app, settings, "warning", access_log=False)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])))
    thread.start()
    deadline = time.monotonic() + READ_DEADLINE_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        release.set()
        server.should_exit = True
        thread.join(READ_DEADLINE_S)
        sock.close()
        release.clear()
        holding.clear()


def connect(port: int) -> socket.socket:
    client = socket.create_connection(("127.0.0.1", port))
    client.settimeout(READ_DEADLINE_S)  # NOTE: unbounded servers fail here, not hang
    return client


def read_all(client: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    while chunk := client.recv(65536):
        received += chunk
    return received


def read_answer(client: socket.socket) -> bytes:
    """One answer of the app's (its body is "ok"), the connection left open."""
    received = b""
    while not received.endswith(b"\r\n\r\nok"):
        chunk = client.recv(65536)
        assert chunk, f"closed after {received!r}"
        received += chunk
    return received


def refused(client: socket.socket, status: bytes) -> bool:
    """Whether the server answered `status` and closed, or closed at once: closing with the
    client's bytes unread resets the connection, and the answer may be lost in the reset."""
    try:
        return read_all(client).startswith(b"HTTP/1.1 %s " % status)
    except ConnectionResetError:
        return True


def request(port: int, path: str = "/", extra_headers: bytes = b"") -> bytes:
    with connect(port) as client:
        head = b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" % path.encode()
        client.sendall(head + extra_headers + b"\r\n")
        return read_all(client)


def test_headers_sent_too_slowly_get_408_and_the_connection_closed():
    with serving(header_timeout=0.5) as port, connect(port) as client:
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: a")
        started = time.monotonic()
        answer = read_all(client)
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert time.monotonic() - started < READ_DEADLINE_S


def test_headers_trickled_a_byte_at_a_time_still_time_out():
    with serving(header_timeout=0.5) as port, connect(port) as client:
        client.sendall(b"GET / HTTP/1.1\r\n")
        deadline = time.monotonic() + READ_DEADLINE_S
        with pytest.raises(OSError):  # NOTE: reset or broken pipe once it is closed
            while time.monotonic() < deadline:
                client.sendall(b"a")
                time.sleep(0.05)
        assert time.monotonic() < deadline


def test_a_connection_that_sends_nothing_is_closed():
    with serving(header_timeout=0.5) as port, connect(port) as client:
        assert read_all(client) == b""


def test_a_prompt_request_is_answered_and_its_connection_kept_alive():
    with serving(header_timeout=0.5) as port, connect(port) as client:
        for _ in range(2):
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_answer(client).startswith(b"HTTP/1.1 200 ")


def test_one_oversized_header_gets_431():
    with serving(max_header_bytes=4096) as port:
        answer = request(port, extra_headers=b"X-Big: " + b"a" * 100_000 + b"\r\n")
        assert answer.startswith(b"HTTP/1.1 431 ")
        assert b"over 4096 bytes" in answer
        assert request(port, extra_headers=b"X-Fits: " + b"a" * 3000 + b"\r\n").startswith(
            b"HTTP/1.1 200 "
        )


def test_an_oversized_header_still_arriving_is_refused_before_its_end():
    with serving(max_header_bytes=4096) as port, connect(port) as client:
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
        with contextlib.suppress(OSError):  # NOTE: the server may close while we send
            for _ in range(64):
                client.sendall(b"a" * 1024)
        assert refused(client, b"431")


def test_headers_under_the_limit_that_arrive_in_pieces_are_answered():
    with serving(max_header_bytes=4096) as port, connect(port) as client:
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n")
        for i in range(10):
            client.sendall(b"X-%d: %s\r\n" % (i, b"a" * 280))
            time.sleep(0.02)  # NOTE: so that the server reads them one by one
        client.sendall(b"\r\n")
        assert read_all(client).startswith(b"HTTP/1.1 200 ")


def test_too_many_headers_get_431():
    with serving(max_header_count=20) as port:
        flood = b"".join(b"X-%d: 1\r\n" % i for i in range(1000))
        answer = request(port, extra_headers=flood)
        assert answer.startswith(b"HTTP/1.1 431 ")
        assert b"more than 20 request headers" in answer
        few = b"".join(b"X-%d: 1\r\n" % i for i in range(10))
        assert request(port, extra_headers=few).startswith(b"HTTP/1.1 200 ")


def test_at_the_connection_cap_a_new_client_closes_the_longest_waiting_slow_one():
    with serving(max_connections=4, header_timeout=60) as port:
        slow = [connect(port) for _ in range(4)]
        for client in slow:
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            time.sleep(0.05)  # NOTE: an order among them; the oldest must go first
        try:
            assert request(port).startswith(b"HTTP/1.1 200 ")
            assert read_all(slow[0]).startswith(b"HTTP/1.1 408 ")
        finally:
            for client in slow:
                client.close()


def test_at_the_connection_cap_with_every_request_in_progress_a_new_one_gets_503():
    with serving(max_connections=2) as port:
        busy = [connect(port) for _ in range(2)]
        try:
            for client in busy:
                client.sendall(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
            deadline = time.monotonic() + READ_DEADLINE_S
            while len(holding) < 2:
                assert time.monotonic() < deadline, "the holds did not reach the app"
                time.sleep(0.01)
            with connect(port) as client:
                client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                assert refused(client, b"503")
            release.set()
            for client in busy:
                assert read_answer(client).startswith(b"HTTP/1.1 200 ")
        finally:
            for client in busy:
                client.close()


def test_the_connection_cap_leaves_file_descriptors_for_the_legs():
    assert connection_cap(0, 20_000) == 20_000 // FDS_PER_CONNECTION
    assert connection_cap(0, 1 << 20) == 16384
    assert connection_cap(100, 20_000) == 100
    assert connection_cap(100_000, 20_000) == 20_000 // FDS_PER_CONNECTION


@pytest.mark.parametrize(
    "flag", [{"header_timeout": 0}, {"max_header_bytes": 0}, {"max_connections": -1}]
)
def test_bad_limits_are_refused(flag):
    with pytest.raises(ValueError, match="must be"):
        HttpSettings(**flag)
