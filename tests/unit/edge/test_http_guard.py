"""The bounds every pdserve HTTP process serves with (edge/http_guard.py), against a real
uvicorn server built from the Config that commands/common.py builds for router and workers:
slow headers and bodies (slowloris), header floods, and the connection cap."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import pytest
import uvicorn

from pdserve.commands.common import uvicorn_config
from pdserve.edge.http_guard import FDS_PER_CONNECTION, connection_cap
from pdserve.protocol.http_settings import HttpSettings
from tests.waiting import wait_until

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


READ_DEADLINE_S = 10.0
STREAM_CHUNKS = 6


async def app(scope, receive, send):
    """200 "ok": at once (the body unread); /hold once `release` is set (a request in
    progress); /read once its whole body has arrived (its size in x-body-bytes); /stream in
    STREAM_CHUNKS chunks, one every `stream_gap_s`."""
    if scope["type"] != "http":
        return
    headers = [(b"content-length", b"2")]
    if scope["path"] in ("/hold", "/read"):
        holding.append(scope)
    while scope["path"] == "/hold" and not release.is_set():
        await asyncio.sleep(0.01)
    if scope["path"] == "/read":
        size = await read_body(receive)
        body_ends.append(size)
        if size == "disconnect":
            return
        headers.append((b"x-body-bytes", b"%d" % size))
    if scope["path"] == "/stream":
        await stream(send)
        return
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


async def read_body(receive) -> int | str:
    """The body's size, or "disconnect" if the client left first."""
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return "disconnect"
        size += len(message["body"])
        if not message.get("more_body", False):
            return size


async def stream(send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for _ in range(STREAM_CHUNKS):
        await send({"type": "http.response.body", "body": b".", "more_body": True})
        await asyncio.sleep(stream_gap_s)  # NOTE: a slow answer is what is tested
    await send({"type": "http.response.body", "body": b"ok"})


release = threading.Event()
holding: list[dict] = []
body_ends: list[int | str] = []
stream_gap_s = 0.1


@contextlib.contextmanager
def serving(keep_alive_s: float | None = None, **limits):
    settings = HttpSettings(port=0, **limits)
    config = uvicorn_config(app, settings, "warning")
    if keep_alive_s is not None:
        config.timeout_keep_alive = keep_alive_s
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
        body_ends.clear()


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


def error_of(answer: bytes) -> dict:
    """The `error` object of a refusal: OpenAI's shape, as every other error of pdserve's."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_refusals_are_openai_errors_naming_the_limit():
    with serving(max_header_bytes=4096, header_timeout=0.5) as port:
        error = error_of(request(port, extra_headers=b"X-Big: " + b"a" * 100_000 + b"\r\n"))
        assert error["code"] == "request_header_fields_too_large"
        assert error["type"] == "invalid_request_error"
        assert "over 4096 bytes" in error["message"]
        with connect(port) as client:
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: a")
            error = error_of(read_all(client))
        assert error["code"] == "request_timeout"
        assert error["message"] == "request headers not received in time"


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


def post_head(path: str, length: int, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n" % (
        path.encode(),
        length,
        extra,
    )


def trickle(client: socket.socket, stop: threading.Event) -> None:
    """A byte every 50 ms until `stop` or the server closes."""
    with contextlib.suppress(OSError):
        while not stop.wait(0.05):
            client.sendall(b"a")


def test_a_body_that_stops_arriving_gets_408_and_the_app_sees_the_client_leave():
    with serving(body_timeout=0.5) as port, connect(port) as client:
        client.sendall(post_head("/read", 1_000_000) + b"a" * 10)
        started = time.monotonic()
        answer = read_all(client)
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert b"request body not received in time" in answer
        assert time.monotonic() - started < READ_DEADLINE_S
        wait_until(lambda: body_ends == ["disconnect"], "the app to see the client leave")


@pytest.mark.parametrize(
    "head",
    [
        post_head("/read", 1_000_000),
        b"POST /read HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1000000\r\n",
    ],
    ids=["content-length", "chunked"],
)
def test_a_body_trickled_a_byte_at_a_time_still_times_out(head):
    stop = threading.Event()
    with serving(body_timeout=0.5) as port, connect(port) as client:
        client.sendall(head)
        sender = threading.Thread(target=trickle, args=(client, stop))
        sender.start()
        started = time.monotonic()
        try:
            assert refused(client, b"408")
        finally:
            stop.set()
            sender.join()
        assert time.monotonic() - started < READ_DEADLINE_S
        wait_until(lambda: body_ends == ["disconnect"], "the app to see the client leave")


def test_a_body_trickled_after_an_early_answer_does_not_hold_the_connection():
    """As the API key check does: a 401 before the body is read."""
    stop = threading.Event()
    with serving(body_timeout=0.5) as port, connect(port) as client:
        client.sendall(post_head("/", 1_000_000))
        assert read_answer(client).startswith(b"HTTP/1.1 200 ")
        sender = threading.Thread(target=trickle, args=(client, stop))
        sender.start()
        try:
            with contextlib.suppress(ConnectionResetError):  # NOTE: see `refused`
                assert read_all(client) == b""  # NOTE: closed, with nothing more to say
        finally:
            stop.set()
            sender.join()


def test_a_connection_answered_before_its_body_ended_closes_once_idle():
    with serving(keep_alive_s=0.3, body_timeout=60) as port, connect(port) as client:
        client.sendall(post_head("/", 10))
        assert read_answer(client).startswith(b"HTTP/1.1 200 ")
        client.sendall(b"a" * 10)  # NOTE: the body's end: idle from here
        assert read_all(client) == b""


def test_a_large_body_sent_in_pieces_within_the_deadline_is_read_whole():
    size = 8 << 20
    with serving(body_timeout=READ_DEADLINE_S) as port, connect(port) as client:
        client.sendall(post_head("/read", size))
        for _ in range(8):
            client.sendall(b"a" * (size // 8))
        assert b"x-body-bytes: %d\r\n" % size in read_answer(client)
        assert body_ends == [size]


def test_a_streamed_answer_outlasting_the_body_deadline_is_not_cut():
    with serving(body_timeout=0.2) as port, connect(port) as client:
        client.sendall(post_head("/stream", 2, b"Connection: close\r\n") + b"{}")
        answer = read_all(client)  # NOTE: STREAM_CHUNKS * 0.1 s, three times the deadline
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert answer.count(b"1\r\n.\r\n") == STREAM_CHUNKS
        assert answer.endswith(b"2\r\nok\r\n0\r\n\r\n")


def test_a_stream_begun_before_its_body_arrived_is_not_cut_and_then_closes():
    with serving(keep_alive_s=60, body_timeout=0.2) as port, connect(port) as client:
        client.sendall(post_head("/stream", 1_000_000))  # NOTE: the body never comes
        answer = read_all(client)
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert answer.count(b"1\r\n.\r\n") == STREAM_CHUNKS
        assert answer.endswith(b"2\r\nok\r\n0\r\n\r\n")


def test_at_the_connection_cap_a_new_client_closes_the_longest_waiting_slow_body():
    with serving(max_connections=4, body_timeout=60) as port:
        slow = [connect(port) for _ in range(4)]
        try:
            for arrived, client in enumerate(slow, start=1):
                client.sendall(post_head("/read", 1_000_000) + b"a")
                # NOTE: an order among them; the oldest must go first
                wait_until(lambda n=arrived: len(holding) == n, "the slow body to reach the app")
            assert request(port, "/liveness").startswith(b"HTTP/1.1 200 ")
            assert read_all(slow[0]).startswith(b"HTTP/1.1 408 ")
            wait_until(lambda: body_ends == ["disconnect"], "the app to see the client leave")
        finally:
            for client in slow:
                client.close()


def test_the_connection_cap_leaves_file_descriptors_for_the_legs():
    assert connection_cap(0, 20_000) == 20_000 // FDS_PER_CONNECTION
    assert connection_cap(0, 1 << 20) == 16384
    assert connection_cap(100, 20_000) == 100
    assert connection_cap(100_000, 20_000) == 20_000 // FDS_PER_CONNECTION


@pytest.mark.parametrize(
    "flag",
    [
        {"header_timeout": 0},
        {"body_timeout": 0},
        {"body_timeout": float("nan")},
        {"max_header_bytes": 0},
        {"max_connections": -1},
    ],
)
def test_bad_limits_are_refused(flag):
    with pytest.raises(ValueError, match="must be"):
        HttpSettings(**flag)
