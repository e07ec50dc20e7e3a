"""Fake prefill/decode workers for router tests: an httpx transport the router's client uses
in-process, and a real HTTP server that drops reused keep-alive connections. Torch-free."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from pdserve.protocol.failures import Failure, FailureKind, FailureStage
from pdserve.router.config import RouterConfig
from pdserve.server.errors import failure_error

Leg = Callable[[dict], Awaitable[httpx.Response]]


def completion(text: str = "ok") -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"text": text}]})


def worker_error(status: int, message: str, kind: str, code: str | None = None) -> httpx.Response:
    error = {"message": message, "type": kind, "param": None, "code": code}
    return httpx.Response(status, json={"error": error})


def failed_answer(kind: FailureKind, stream: bool = False) -> httpx.Response:
    """A worker's answer to a request that failed with `kind`, made as a worker makes it
    (server/errors.failure_error): the JSON error, or a stream whose first event is it."""
    error = failure_error(Failure(kind, FailureStage.TRANSFER, f"the room failed ({kind})"))
    if stream:
        return httpx.Response(200, content=(error.sse() + "data: [DONE]\n\n").encode())
    return httpx.Response(error.status, json=error.body())


def router_metric(client, name: str) -> float:
    """A router metric's value, read from its /metrics (`client`: a TestClient)."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"pdserve_router:{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


class FakeWorkers:
    """One prefill (`http://prefill`) and one decode worker (`http://decode`) behind an httpx
    transport: /health answers 200; a POST runs the role's leg (an async function of the body).
    As with real workers, the default decode leg answers only once the prefill leg of its
    room succeeded. Records the legs the router cancelled (gave up on), and the rooms it then
    asked each worker to abort (`/abort_room`)."""

    def __init__(self, prefill: Leg | None = None, decode: Leg | None = None):
        self.legs = {"prefill": prefill or _answer, "decode": decode or self._after_prefill}
        self.prefilled: dict[int, asyncio.Event] = {}
        self.cancelled: list[str] = []
        self.aborted_rooms: list[tuple[str, int]] = []
        self.posts: list[str] = []
        self.transport = httpx.MockTransport(self._handle)

    def config(self, **options) -> RouterConfig:
        options.setdefault("health_check_interval_s", 60.0)  # NOTE: one check, at start-up
        return RouterConfig(
            prefill=(("http://prefill", 8998),), decode=("http://decode",), **options
        )

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200 if request.url.path == "/health" else 404)
        role, body = request.url.host, json.loads(request.content)
        if request.url.path == "/abort_room":
            self.aborted_rooms.append((role, body["bootstrap_room"]))
            return httpx.Response(200, json={"aborted": True})
        self.posts.append(role)
        try:
            response = await self.legs[role](body)
        except asyncio.CancelledError:
            self.cancelled.append(role)
            raise
        if role == "prefill" and response.status_code == 200:
            self._room(body).set()
        return response

    def _room(self, body: dict) -> asyncio.Event:
        return self.prefilled.setdefault(body["bootstrap_room"], asyncio.Event())

    async def _after_prefill(self, body: dict) -> httpx.Response:
        await self._room(body).wait()
        return completion()


async def _answer(body: dict) -> httpx.Response:
    return completion()


class _JsonWorker(BaseHTTPRequestHandler):
    """A loopback HTTP/1.1 worker that answers JSON, quietly."""

    protocol_version = "HTTP/1.1"  # NOTE: keep-alive, so the router reuses connections

    def _answer(self, status: int, body: dict) -> None:
        self.served = getattr(self, "served", 0) + 1
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class _DropsReusedConnections(_JsonWorker):
    """Serves one request per connection and then drops the connection on the next POST,
    unanswered, as a worker does that closed an idle keep-alive connection while the router
    was sending on it. Answers like a prefill and a decode worker at once."""

    def do_GET(self):
        self._answer(200, {"disaggregation_bootstrap_port": 8998})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.server.mode == "hang":
            self.rfile.read(1)  # NOTE: returns when the router closes the connection
        if getattr(self, "served", 0) or self.server.mode != "drop_reused":
            self.close_connection = True
            return
        self._answer(200, {"text": "ok"})


class _Completes(_JsonWorker):
    """A colocated worker: /health and model info answer 200, every POST a completion."""

    def do_GET(self):
        self._answer(200, {} if self.path == "/health" else {"data": []})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.server.lock:
            self.server.posts += 1
        self._answer(200, {"id": "cmpl", "object": "text_completion", "choices": [{"text": "ok"}]})


class _LoopbackServer:
    """A handler class served on a loopback port by a thread, while in a `with` block."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]):
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class CompletingWorker(_LoopbackServer):
    """`_Completes` on a loopback port, counting the POSTs it answered (`posts`)."""

    def __init__(self):
        super().__init__(_Completes)
        self.server.lock, self.server.posts = threading.Lock(), 0

    @property
    def posts(self) -> int:
        return self.server.posts


class KeepAliveDropper(_LoopbackServer):
    """`_DropsReusedConnections` on a loopback port. mode: `drop_reused` (the POST on a
    reused connection), `drop_all` (every POST), `hang` (every POST stays unanswered until
    the router closes its connection: a decode leg waiting for a transfer)."""

    def __init__(self, mode: str = "drop_reused"):
        super().__init__(_DropsReusedConnections)
        self.server.mode = mode


class _StopsAnswering(_Completes):
    """`_Completes` until the server's `stopped` is set; from then on every request, /health
    too, stays unanswered (the connection open, as a SIGSTOPped worker's kernel keeps it)
    until `released`."""

    def do_GET(self):
        self._hang_if_stopped()
        super().do_GET()

    def do_POST(self):
        self._hang_if_stopped()
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        with self.server.lock:
            self.server.posts += 1
        if body.get("stream") is not True:
            self._answer(200, {"object": "text_completion", "choices": [{"text": "ok"}]})
            return
        # NOTE: a stream's first event, then nothing until released (stopped mid-stream)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        event = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.wfile.flush()
        self.server.released.wait(60)
        self.close_connection = True

    def _hang_if_stopped(self):
        if self.server.stopped.is_set():
            self.server.released.wait(60)
            self.close_connection = True
            raise ConnectionAbortedError("released")


class StoppableWorker(_LoopbackServer):
    """`_StopsAnswering` on a loopback port: `stop()` it, and it answers nothing more."""

    def __init__(self):
        super().__init__(_StopsAnswering)
        self.server.lock, self.server.posts = threading.Lock(), 0
        self.server.stopped, self.server.released = threading.Event(), threading.Event()

    def stop(self) -> None:
        self.server.stopped.set()

    def __exit__(self, *exc) -> None:
        self.server.released.set()
        super().__exit__(*exc)
