"""The soak's hostile traffic (tests/e2e/soak_hostile.py): the engine watch tells an engine
restart and an unplanned worker restart from a planned kill; the abort flood posts random
rooms to every worker and reports any answer but 200 and 503."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from tests.e2e import soak_hostile
from tests.e2e.soak_hostile import AbortFlood, EngineWatch
from tests.waiting import wait_until


@pytest.fixture
def processes(monkeypatch):
    """name -> [front pid, engine pid] of fake workers, which the watch reads."""
    table = {"http://a": [10, 11], "http://b": [20, 21]}
    engines = {}

    def engine_pid_of(front: int) -> int:
        if front not in engines:
            raise LookupError(f"no engine process under {front}")
        return engines[front]

    monkeypatch.setattr(soak_hostile, "engine_pid_of", engine_pid_of)

    def front_pid(url: str) -> int | None:
        front, engine = table[url]
        if front is not None and engine is not None:
            engines[front] = engine
        else:
            engines.pop(front, None)
        return front

    return table, front_pid


def test_the_engine_watch_flags_an_engine_restart_under_the_same_front_end(processes):
    table, front_pid = processes
    watch = EngineWatch({"prefill 0": "http://a", "decode 0": "http://b"}, front_pid)
    watch.check()
    assert watch.restarts == []
    table["http://a"][1] = 12  # the worker started a new engine
    watch.check()
    watch.check()
    assert _without_times(watch.restarts) == ["prefill 0's engine restarted at + s (pid 11 -> 12)"]


def test_the_engine_watch_takes_a_killed_worker_back_and_flags_one_not_killed(processes):
    table, front_pid = processes
    watch = EngineWatch({"prefill 0": "http://a", "decode 0": "http://b"}, front_pid)
    watch.killed(10)
    table["http://a"] = [None, None]  # down
    watch.check()
    table["http://a"] = [30, None]  # its new front end, the engine not started yet
    watch.check()
    table["http://a"] = [30, 31]
    table["http://b"] = [40, 41]  # a worker that restarted on its own
    watch.check()
    assert _without_times(watch.restarts) == ["decode 0 restarted at + s, not killed by the soak"]
    table["http://a"] = [30, 32]  # the restarted worker's engine dies in turn
    watch.stop()
    assert _without_times(watch.restarts[1:]) == [
        "prefill 0's engine restarted at + s (pid 31 -> 32)"
    ]


def _without_times(found: list[str]) -> list[str]:
    return [re.sub(r"\+\d+ s", "+ s", line) for line in found]


class _Worker(BaseHTTPRequestHandler):
    rooms: ClassVar[list[int]] = []  # NOTE: each test makes a subclass with its own
    status = 200

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/abort_room"
        self.rooms.append(body["bootstrap_room"])
        self.send_response(self.status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status", [200, 500])
def test_the_abort_flood_posts_random_rooms_and_reports_what_was_refused(status):
    handler = type("Worker", (_Worker,), {"rooms": [], "status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    flood = AbortFlood([url, "http://127.0.0.1:1"], rate_per_s=200).start()
    try:
        wait_until(lambda: len(handler.rooms) >= 5, "five posts", 20)
    finally:
        flood.stop()
        server.shutdown()
        server.server_close()
    assert len(set(handler.rooms)) == len(handler.rooms)  # random rooms
    assert all(0 <= room <= soak_hostile.MAX_ROOM for room in handler.rooms)
    assert flood.answers["ConnectError"] > 0  # the other "worker": nothing listens there
    if status == 200:
        assert flood.problems() == []
    else:
        assert flood.problems()[0] == f"/abort_room answered 500 {flood.answers[500]} times"
