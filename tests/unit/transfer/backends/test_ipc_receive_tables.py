"""What the decode side of `ipc` keeps per prefill peer and per room (`IpcReceivePlane`) goes
with its peer and its room: nothing is left once rooms end and are released, a peer is
forgotten, or the client stops; and only a room's writer can say its writes are over."""

from __future__ import annotations

import os

import pytest

from pdserve.protocol.failures import FailureKind
from pdserve.transfer.kv_piece import PageSpan
from pdserve.transfer.room_state import TransferState
from tests.e2e.transfer_peers import Case, record
from tests.unit.transfer.backends.test_transfer_ipc import (
    exited_pid,
    open_room,
    running_ipc_pair,
    write_piece,
)
from tests.waiting import wait_until

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


@pytest.fixture
def pair():
    with running_ipc_pair() as started:
        yield started


def room_entries(client) -> tuple[dict, set, dict]:
    """(the writers by room, the released rooms, the kept rooms)."""
    with client.lock:
        return dict(client.plane.writers), set(client.plane.released), dict(client.unsettled)


def nothing_kept(client) -> bool:
    return room_entries(client) == ({}, set(), {})


def test_a_room_that_succeeded_leaves_nothing_once_released(pair):
    case = Case(room=10, draft=True)
    sender, receiver = open_room(pair, case)
    assert room_entries(pair.client)[0] == {receiver.entry: os.getpid()}
    write_piece(pair, sender, case, PageSpan(0, 3, 0, 3), then=record(case))
    wait_until(lambda: receiver.poll() is TransferState.SUCCESS, "the room", 20)
    receiver.commit(pair.target)
    pair.client.release(case.room)
    assert nothing_kept(pair.client)


def test_an_aborted_room_leaves_nothing_whichever_comes_first_release_or_prefills_word(pair):
    first, second = Case(room=20, draft=True), Case(room=21, draft=True)
    _, receiver = open_room(pair, first)
    receiver.abort(FailureKind.ABORTED, "the client left")
    wait_until(lambda: receiver.pages_settled, "prefill's RoomReleased", 10)
    assert receiver.entry in room_entries(pair.client)[1]  # released, not yet forgotten
    pair.client.release(first.room)
    assert nothing_kept(pair.client)
    _, receiver = open_room(pair, second)
    receiver.abort(FailureKind.ABORTED, "the client left")
    pair.client.release(second.room)  # kept, unless prefill's word came already
    wait_until(lambda: nothing_kept(pair.client), "the kept room to be forgotten", 10)
    assert receiver.pages_settled


def test_a_room_kept_for_a_prefill_process_that_exited_is_forgotten_at_the_next_tick(pair):
    case = Case(room=30, draft=True)
    sender, receiver = open_room(pair, case)
    assert sender.destination(PageSpan(0, 1)) is not None  # a write in flight: no word comes
    with pair.client.lock:
        pair.client.plane.writers[receiver.entry] = exited_pid()  # as if prefill had exited
    receiver.abort(FailureKind.ABORTED, "the client left")
    pair.client.release(case.room)
    wait_until(lambda: nothing_kept(pair.client), "the kept room to be forgotten", 10)
    assert receiver.pages_settled


def test_room_released_from_a_process_that_is_not_the_rooms_writer_is_ignored(pair):
    client, case = pair.client, Case(room=40, draft=True)
    sender, receiver = open_room(pair, case)
    assert sender.destination(PageSpan(0, 1)) is not None  # a write in flight: no word comes
    receiver.abort(FailureKind.ABORTED, "the client left")
    client.release(case.room)
    with client.lock:
        client.plane.writers[receiver.entry] = os.getppid()  # another live process
    client.room_released(receiver.peer, case.room)
    assert not receiver.pages_settled
    assert room_entries(client) == (
        {receiver.entry: os.getppid()},
        set(),
        {case.room: receiver.entry},
    )
    with client.lock:
        client.plane.writers[receiver.entry] = os.getpid()  # the peer's own process
    client.room_released(receiver.peer, case.room)
    assert receiver.pages_settled and nothing_kept(client)


def test_a_forgotten_prefill_peer_leaves_no_entry(pair):
    client = pair.client
    _, receiver = open_room(pair, Case(room=50, draft=True))
    peer = receiver.peer
    assert list(client.plane.prefills) == [peer.key]
    assert client.plane.prefills[peer.key].peer is peer
    client.io.call(lambda: client.drop_peer(peer, FailureKind.PEER_LOST, "silent 5.0 s"))
    wait_until(lambda: not client.plane.prefills, "the peer's entry to go", 10)
    assert receiver.poll() is TransferState.FAILED
    _, receiver = open_room(pair, Case(room=51, draft=True))  # a new peer, a new entry
    assert list(client.plane.prefills) == [receiver.peer.key]
    assert client.plane.prefills[receiver.peer.key].peer is receiver.peer is not peer


def test_close_leaves_no_entry():
    with running_ipc_pair() as started:
        case = Case(room=60, draft=True)
        sender, _ = open_room(started, case)
        assert sender.destination(PageSpan(0, 1)) is not None  # a write in flight
        plane = started.client.plane
        assert plane.prefills and plane.writers
    assert (plane.prefills, plane.writers, plane.released) == ({}, {}, set())


def test_a_kept_rooms_id_is_refused_after_its_tombstone_was_evicted(pair):
    client, case = pair.client, Case(room=70, draft=True)
    sender, receiver = open_room(pair, case)
    assert sender.destination(PageSpan(0, 1)) is not None  # a write in flight: no word comes
    receiver.abort(FailureKind.ABORTED, "the client left")
    client.release(case.room)
    client.tombstones.capacity = 1
    client.tombstones.add(71)  # a flood of other rooms evicts room 70's tombstone
    assert case.room not in client.tombstones and case.room in client.unsettled
    pages = list(case.decode_pages)
    with pytest.raises(ValueError, match="already in use"):
        client.receiver(case.room, "127.0.0.1", pair.server.port, pages, pages)
    assert client.unsettled[case.room] is receiver.entry  # the kept room is not overwritten
