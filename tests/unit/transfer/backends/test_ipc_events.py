"""Decode keeps the write events a prefill peer announced open, by handle (`ipc_events`): one
handle is opened once, however many pieces carry it; the cache stays bounded; a handle that
cannot be opened says why. (The ring prefill records into needs a GPU: tests/gpu.)"""

from __future__ import annotations

import pytest
import torch

from pdserve.transfer.backends.ipc.ipc_events import IPC_EVENT_BYTES, OpenedEvents


@pytest.fixture
def opened(monkeypatch):
    """Handles opened so far; opening makes an object standing for the event."""
    calls = []

    def open_handle(device, handle):
        if handle.startswith(b"\xff"):
            raise RuntimeError("invalid resource handle")
        calls.append(handle)
        return object()

    monkeypatch.setattr(torch.cuda.Event, "from_ipc_handle", open_handle)
    return calls


def handle(n: int) -> bytes:
    return n.to_bytes(4, "little") * (IPC_EVENT_BYTES // 4)


def test_a_handle_is_opened_once_and_the_same_event_given_back(opened):
    events = OpenedEvents(torch.device("cuda", 1))
    first = events.open(handle(1))
    assert events.open(handle(1)) is first
    assert events.open(handle(2)) is not first
    assert opened == [handle(1), handle(2)] and len(events) == 2


def test_the_events_kept_are_bounded(opened):
    events = OpenedEvents(torch.device("cuda", 1), limit=4)
    for n in range(9):
        events.open(handle(n))
    assert len(events) <= 4
    events.open(handle(8))
    assert len(opened) == 9  # NOTE: the latest is kept


def test_a_handle_that_cannot_be_opened_says_why(opened):
    events = OpenedEvents(torch.device("cuda", 1))
    assert events.open(b"\x01" * 3) == "a 3-byte event for cuda:1"
    assert "invalid resource handle" in events.open(b"\xff" * IPC_EVENT_BYTES)
    assert OpenedEvents(torch.device("cpu")).open(handle(1)) == "a 64-byte event for cpu"
    assert len(events) == 0 and opened == []


def test_a_peers_events_are_opened_at_its_handshake_and_a_bad_one_refused(opened):
    events = OpenedEvents(torch.device("cuda", 1), limit=4)
    assert events.open_all([handle(1), handle(2)]) is None
    assert opened == [handle(1), handle(2)]
    events.open(handle(2))  # NOTE: a piece that carries one: opened already
    assert opened == [handle(1), handle(2)]
    assert "5 write events, more than the 4" in events.open_all([handle(n) for n in range(5)])
    assert "invalid resource handle" in events.open_all([handle(3), b"\xff" * IPC_EVENT_BYTES])
