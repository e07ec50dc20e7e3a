"""What the prefill side of `ipc` keeps per decode peer and per room (`IpcSendPlane`) goes
with its peer and its room: a room's entry once it ended with no write in flight, a peer's
once it is dropped, everything at `stop`; and a failed room's decode hears that
its pages are free only once no write of ours is in flight."""

from __future__ import annotations

import pytest

from pdserve.protocol.failures import FailureKind
from pdserve.transfer.kv_piece import PageSpan
from pdserve.transfer.room_state import TransferState
from tests.e2e.transfer_peers import Case, record
from tests.unit.transfer.backends.test_transfer_ipc import open_room, running_ipc_pair, write_piece
from tests.waiting import wait_until

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


@pytest.fixture
def pair():
    with running_ipc_pair() as started:
        yield started


def room_entries(server) -> tuple[dict, dict]:
    """(each attached room's writes, the failed rooms with writes in flight)."""
    with server.lock:
        return dict(server.plane.writes), dict(server.plane.unreleased)


def test_a_room_that_succeeded_leaves_no_entry(pair):
    case = Case(room=10, draft=True)
    sender, receiver = open_room(pair, case)
    writes = room_entries(pair.server)[0][sender.state]
    assert (writes.pages, writes.draft_pages) == (list(case.decode_pages),) * 2
    write_piece(pair, sender, case, PageSpan(0, 3, 0, 3), then=record(case))
    wait_until(lambda: sender.poll() is TransferState.SUCCESS, "decode's ack", 20)
    wait_until(lambda: room_entries(pair.server) == ({}, {}), "the room's entry to go", 10)
    assert receiver.poll() is TransferState.SUCCESS


def test_a_failed_room_is_released_to_decode_only_once_its_last_write_ended(pair):
    case = Case(room=20, draft=True)
    sender, receiver = open_room(pair, case)
    assert sender.destination(PageSpan(0, 1)) is not None  # a write in flight
    sender.abort(FailureKind.ABORTED, "the prefill leg was cancelled")
    wait_until(lambda: receiver.poll() is TransferState.FAILED, "decode to hear the abort", 10)
    writes, unreleased = room_entries(pair.server)
    assert writes[sender.state].in_flight == 1 and unreleased == {case.room: sender.state}
    assert not receiver.pages_settled  # NOTE: the write may still land in decode's pages
    sender.write_failed("the copy was never queued")  # the write ends
    wait_until(lambda: receiver.pages_settled, "prefill's RoomReleased", 10)
    assert room_entries(pair.server) == ({}, {})


def test_no_write_opens_once_the_room_ended(pair):
    case = Case(room=30, draft=True)
    sender, receiver = open_room(pair, case)
    sender.abort(FailureKind.ABORTED, "the prefill leg was cancelled")
    wait_until(lambda: room_entries(pair.server) == ({}, {}), "the room's entry to go", 10)
    assert sender.destination(PageSpan(0, 1)) is None
    assert room_entries(pair.server) == ({}, {})
    wait_until(lambda: receiver.pages_settled, "prefill's RoomReleased", 10)


def test_a_dropped_decode_peer_leaves_no_entry(pair):
    server = pair.server
    sender, _ = open_room(pair, Case(room=40, draft=True))
    peer = sender.peer
    assert list(server.plane.decodes) == [peer.key]
    assert server.plane.decode_of(peer).pools
    server.io.call(lambda: server.drop_peer(peer, FailureKind.PEER_LOST, "silent 5.0 s"))
    wait_until(lambda: not server.plane.decodes, "the peer's entry to go", 10)
    assert sender.poll() is TransferState.FAILED
    assert room_entries(server) == ({}, {})
    sender, _ = open_room(pair, Case(room=41, draft=True))  # decode comes back: a new entry
    assert server.plane.decode_of(sender.peer) is not None and sender.peer is not peer


def test_stop_leaves_no_entry():
    with running_ipc_pair() as started:
        sender, _ = open_room(started, Case(room=60, draft=True))
        assert sender.destination(PageSpan(0, 1)) is not None  # a write in flight
        plane = started.server.plane
        assert plane.decodes and plane.writes
    assert (plane.decodes, plane.writes, plane.unreleased) == ({}, {}, {})


def test_a_rooms_pages_are_known_before_the_worker_can_see_it_attached(pair, monkeypatch):
    """The worker writes as soon as the room waits for its KV: `destination` must not find
    the room attached but its page ids unknown (it would answer None: the room ended)."""
    plane, seen = pair.server.plane, []
    attached = plane.room_attached

    def watched(room, accepted):
        seen.append(room.poll())  # what the worker's thread could see at this moment
        attached(room, accepted)

    monkeypatch.setattr(plane, "room_attached", watched)
    sender, _ = open_room(pair, Case(room=70, draft=True))
    assert seen == [TransferState.BOOTSTRAPPING]
    assert sender.destination(PageSpan(0, 1)) is not None
