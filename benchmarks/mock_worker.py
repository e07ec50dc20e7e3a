"""A mock prefill or decode worker for router benchmarks: HTTP/1.1 on raw asyncio streams, so
that it costs as little CPU as possible and the same for every router in front of it.

Both roles answer `GET /health` (200) and any other GET with a small JSON object (routers ask
for server or model info at start-up). A POST to a generation path:
- prefill: answers at once (a JSON completion; for a body with `"stream": true`, as SGLang's
  router sends both legs the same body, a one-event stream);
- decode: streams `max_tokens` OpenAI chat.completion.chunk events, one HTTP chunk each, then
  `[DONE]`; every content event carries the time it was written (`time.monotonic()`, the same
  clock in every process of a Linux machine) as `"content": "t<seconds>"`, so that a client
  can tell how long each token took to reach it. A body without `stream` gets one JSON answer.
  The pace between events is `interval_s`, set with `POST /mock/pace {"interval_s": S}` (0: as
  fast as the socket takes them).

    python benchmarks/mock_worker.py --role decode --port 31000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

CHUNK_HEAD = (
    b'data: {"id":"chatcmpl-mock","object":"chat.completion.chunk","created":0,'
    b'"model":"mock","choices":[{"index":0,"delta":'
)


class MockWorker:
    def __init__(self, role: str):
        self.role = role
        self.interval_s = 0.0

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                method, path, body = request
                await self.answer(writer, method, path, body)
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            print("mock", e, flush=True)
            return
        finally:
            writer.close()

    async def answer(self, writer, method: str, path: str, body: bytes) -> None:
        if method == "GET":
            status = 200 if path in ("/health", "/health_generate") or "info" in path else 404
            info = {"role": self.role, "model_path": "mock", "disaggregation_bootstrap_port": 1}
            _write_json(writer, status, info)
        elif path == "/mock/pace":
            self.interval_s = float(json.loads(body)["interval_s"])
            _write_json(writer, 200, {"interval_s": self.interval_s})
        else:
            request = json.loads(body) if body else {}
            streamed = request.get("stream") is True
            if self.role == "prefill" or not streamed:
                if streamed:
                    await self.stream(writer, 1)
                else:
                    _write_json(writer, 200, _completion(_max_tokens(request, 1)))
            else:
                await self.stream(writer, _max_tokens(request, 16))
        await writer.drain()

    async def stream(self, writer: asyncio.StreamWriter, tokens: int) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        _write_chunk(writer, CHUNK_HEAD + b'{"role":"assistant","content":""}}]}\n\n')
        for _ in range(tokens):
            if self.interval_s > 0:
                await asyncio.sleep(self.interval_s)
            else:
                await asyncio.sleep(0)  # NOTE: concurrent streams take turns
            content = f'{{"content":"t{time.monotonic():.6f}"}},"finish_reason":null}}]}}\n\n'
            _write_chunk(writer, CHUNK_HEAD + content.encode())
        _write_chunk(writer, CHUNK_HEAD + b'{},"finish_reason":"length"}]}\n\n')
        _write_chunk(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    """(method, path, body) of the next request on a keep-alive connection; None at its end."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    request_line, *lines = head.decode("latin-1").split("\r\n")
    if request_line.count(" ") != 2:
        raise ConnectionError(f"not an HTTP/1.1 request: {request_line[:40]!r}")
    method, path, _ = request_line.split(" ", 2)
    headers = {}
    for line in lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readuntil(b"\r\n")
    else:
        body = b""
    return method, path.split("?", 1)[0], body


def _max_tokens(request: dict, default: int) -> int:
    """SGLang's router sends OpenAI's newer name for `max_tokens`."""
    return int(request.get("max_completion_tokens") or request.get("max_tokens") or default)


def _write_json(writer: asyncio.StreamWriter, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    writer.write(
        f"HTTP/1.1 {status} {'OK' if status == 200 else 'Not Found'}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n".encode()
        + data
    )


def _write_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))


def _completion(tokens: int) -> dict:
    return {
        "id": "chatcmpl-mock",
        "object": "chat.completion",
        "created": 0,
        "model": "mock",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x" * tokens},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1},
    }


async def serve(role: str, host: str, port: int) -> None:
    worker = MockWorker(role)
    server = await asyncio.start_server(worker.serve_connection, host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.role, args.host, args.port))


if __name__ == "__main__":
    main()
