"""A run spread over client processes (`pdserve.bench.processes`) against a real local
streaming server: every conversation is sent once, by one process, no earlier than the one
arrival schedule says, and its record comes back whole; what a process failing says."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import threading

import pytest

from pdserve.bench.client import ClientSettings
from pdserve.bench.processes import _expect, run_load_in_processes
from pdserve.bench.runner import Load, arrival_offsets
from pdserve.bench.workloads import Conversation, Turn

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


def _event(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data)
    return f"data: {text}\n\n".encode()


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One completion per connection: the prompt's first id, as text, in three chunks."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    body = json.loads(await reader.readexactly(length))
    word = str(body["prompt"][0])
    events = [_event({"choices": [{"index": 0, "text": word}]}) for _ in range(3)]
    events.append(_event({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}))
    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n")
    for data in [*events, _event("[DONE]")]:
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()


@pytest.fixture(scope="module")
def server_url():
    """A streaming server on a thread of its own (the client processes reach it by TCP)."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box = {}

    async def start() -> None:
        box["server"] = await asyncio.start_server(_serve, "127.0.0.1", 0)
        box["port"] = box["server"].sockets[0].getsockname()[1]
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()))
    thread.start()
    assert ready.wait(10)
    yield f"http://127.0.0.1:{box['port']}"
    loop.call_soon_threadsafe(box["server"].close)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def conversations(count: int) -> list[Conversation]:
    return [Conversation((Turn((100 + i, 7), 3),)) for i in range(count)]


def test_every_conversation_is_sent_once_on_schedule_and_its_record_comes_back(server_url):
    settings = ClientSettings(server_url, "tiny", timeout_s=30)
    load, seed = Load(request_rate=40.0), 3
    result = run_load_in_processes(settings, conversations(10), load, processes=2, seed=seed)
    records = result.run.records
    assert [r.conversation for r in records] == list(range(10))
    assert all(r.success and r.output_tokens == 3 for r in records), records[0].error
    assert [r.answer for r in records] == [str(100 + i) * 3 for i in range(10)]
    offsets = arrival_offsets(10, load.request_rate, seed)
    # NOTE: each process's clock is set from the one start the parent named.
    assert all(r.start_s >= offset - 0.005 for r, offset in zip(records, offsets, strict=True))
    assert result.run.duration_s >= offsets[-1]
    assert len(result.cpu_s) == 2 and all(cpu > 0 for cpu in result.cpu_s)


def test_bad_settings_are_refused_before_a_process_starts():
    settings = ClientSettings("http://127.0.0.1:1", "tiny")
    with pytest.raises(ValueError, match="must be >= 1"):
        run_load_in_processes(settings, conversations(1), Load(), processes=0)
    with pytest.raises(ValueError, match="concurrency cap"):
        run_load_in_processes(settings, conversations(2), Load(max_concurrency=1), processes=2)
    assert run_load_in_processes(settings, [], Load(), processes=2).run.records == []


def test_a_process_that_fails_exits_or_says_nothing_is_reported():
    ours, theirs = multiprocessing.Pipe()
    theirs.send_bytes(json.dumps({"error": "ValueError: endpoint 'x'"}).encode())
    with pytest.raises(RuntimeError, match="client process failed: ValueError"):
        _expect(ours, 5, "ready")
    with pytest.raises(TimeoutError, match=r"sent no records within 0\.05 s"):
        _expect(ours, 0.05, "records")
    theirs.close()
    with pytest.raises(RuntimeError, match="exited before it sent its records"):
        _expect(ours, 5, "records")
    ours.close()
