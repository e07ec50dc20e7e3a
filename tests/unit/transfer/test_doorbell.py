"""The doorbell a transfer endpoint rings when a room moves, and the engine loop's wait that
it ends early."""

from __future__ import annotations

import select
import threading
import time
from types import SimpleNamespace

import pytest
import zmq

from pdserve.engine_process.loop import _receive
from pdserve.protocol.failures import FailureKind
from pdserve.transfer.doorbell import Doorbell
from pdserve.transfer.room_state import RoomState, TransferState, room_failure

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


def rung(bell: Doorbell) -> bool:
    return bool(select.select([bell], [], [], 0)[0])


def test_rings_coalesce_until_answered_and_ring_again_after():
    bell = Doorbell()
    try:
        assert not rung(bell)
        for _ in range(3):
            bell.ring()
        assert rung(bell)
        bell.answer()
        assert not rung(bell)  # three rings were one
        bell.ring()
        assert rung(bell)
    finally:
        bell.close()
    bell.ring()  # closed: a no-op, not an error
    bell.answer()


def test_a_room_rings_on_every_move_a_worker_acts_on_and_on_failing_once():
    changes = []
    state = RoomState(7, progress_timeout_s=5, on_change=lambda: changes.append(state.state))
    state.advance(TransferState.WAITING_FOR_INPUT)
    state.advance(TransferState.TRANSFERRING)  # the endpoint's business: no ring
    state.advance(TransferState.SUCCESS)
    other = RoomState(8, progress_timeout_s=5, on_change=lambda: changes.append(other.state))
    other.advance(TransferState.TRANSFERRING)
    other.fail(room_failure("gone", FailureKind.PEER_LOST))
    other.fail(
        room_failure("late", FailureKind.TIMEOUT)
    )  # the first outcome stands: no second ring
    assert changes == [
        TransferState.WAITING_FOR_INPUT,
        TransferState.SUCCESS,
        TransferState.FAILED,
    ]


def test_the_engine_loops_wait_for_messages_ends_when_the_doorbell_rings():
    context = zmq.Context()
    inbox = SimpleNamespace(socket=context.socket(zmq.PULL))
    inbox.socket.bind("inproc://nobody-writes-here")
    bell = Doorbell()
    poller = zmq.Poller()
    poller.register(inbox.socket, zmq.POLLIN)
    poller.register(bell.fileno(), zmq.POLLIN)
    ringer = threading.Timer(0.05, bell.ring)
    try:
        ringer.start()
        started = time.monotonic()
        assert _receive(poller, inbox, 10_000, bell) == []
        assert time.monotonic() - started < 5  # not the 10 s timeout
        assert not rung(bell)  # answered: the next wait sleeps again
    finally:
        ringer.cancel()
        bell.close()
        inbox.socket.close(0)
        context.term()
