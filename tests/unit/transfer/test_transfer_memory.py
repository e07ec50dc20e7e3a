"""The `memory` backend (transfer/backends/memory): settings take it, the command line does
not; its registry's keys, bound, owners and markers; nothing left in it after a room ends
mid-transfer on either side; the handshake refuses a peer outside the process; a piece the
registry does not hold fails its room."""

from __future__ import annotations

import argparse
import dataclasses
import threading

import pytest

from pdserve.protocol.failures import FailureKind
from pdserve.protocol.flags import add_flags
from pdserve.protocol.transfer_messages import KVPiece
from pdserve.transfer.backends import make_backend
from pdserve.transfer.backends.memory.piece_registry import REGISTRY, WITHDRAWN, PieceRegistry
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.kv_piece import OutgoingPiece, PageSpan
from pdserve.transfer.kv_staging import KVStager
from pdserve.transfer.room_state import TransferState
from tests.e2e.transfer_peers import Case, pools
from tests.unit.transfer.test_transfer_in_process import CONFIG, Pair, start_pair
from tests.waiting import wait_until

MEMORY = dataclasses.replace(CONFIG, backend="memory")


def test_the_settings_take_memory_but_the_command_line_does_not_offer_it(capsys):
    assert TransferConfig(backend="memory").backend == make_backend("memory").name == "memory"
    parser = argparse.ArgumentParser()
    add_flags(parser, TransferConfig)
    assert parser.parse_args(["--transfer-backend", "ipc"]).transfer_backend == "ipc"
    with pytest.raises(SystemExit):
        parser.parse_args(["--transfer-backend", "memory"])
    assert "invalid choice: 'memory'" in capsys.readouterr().err


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rooms_of_two_senders_never_share_an_entry():
    registry = PieceRegistry()
    registry.open_sender(1)
    registry.open_sender(2)
    with pytest.raises(ValueError, match="prefill instance 1 has a memory plane already"):
        registry.open_sender(1)
    assert registry.put(1, 7, 0, "a", owner=b"x") is None
    assert registry.put(2, 7, 0, "b", owner=b"y") is None
    assert "KV piece 0 of room 7 is registered already" in registry.put(1, 7, 0, "c", b"x")
    assert registry.take(1, 7, 0, b"y") is None  # another connection's piece stays
    assert registry.take(2, 7, 0, b"y") == "b" and registry.take(1, 7, 0, b"x") == "a"
    assert len(registry) == 0


def test_the_registry_is_bounded_for_every_sender_together():
    registry = PieceRegistry(capacity=2)
    registry.open_sender(1)
    registry.open_sender(2)
    assert registry.put(1, 1, 0, "a", b"x") is None and registry.put(2, 1, 0, "b", b"y") is None
    assert "registry is full (2 pieces" in registry.put(1, 2, 0, "c", b"x")
    registry.close_sender(2)
    assert registry.put(1, 2, 0, "c", b"x") is None
    assert "has no memory plane (it stopped)" in registry.put(2, 1, 1, "d", b"y")


def test_a_withdrawn_piece_answers_withdrawn_until_read_or_expired():
    clock = Clock()
    registry = PieceRegistry(marker_ttl_s=10, clock=clock)
    registry.open_sender(1)
    for room in (1, 2, 3):
        registry.put(1, room, 0, f"piece {room}", b"x")
    registry.withdraw(1, live_rooms={3})
    assert registry.take(1, 1, 0, b"x") is WITHDRAWN
    clock.now = 11
    registry.withdraw(1, live_rooms={3})
    assert registry.take(1, 2, 0, b"x") is None  # expired
    assert registry.take(1, 3, 0, b"x") == "piece 3"


def test_receivers_drop_only_their_own_connections_pieces():
    registry = PieceRegistry()
    registry.open_sender(1)
    registry.put(1, 5, 0, "a", b"x")
    registry.put(1, 5, 1, "b", b"x")
    registry.put(1, 6, 0, "c", b"x")
    registry.put(1, 5, 2, "d", b"y")
    registry.drop_room(1, 5, b"x")
    assert len(registry) == 2
    registry.drop_owner(1, b"x")
    assert registry.take(1, 5, 2, b"y") == "d" and len(registry) == 0
    registry.put(1, 8, 0, "e", b"y")
    registry.withdraw_owner(1, b"y")
    assert registry.take(1, 8, 0, b"y") is WITHDRAWN


@pytest.fixture
def pair():
    assert len(REGISTRY) == 0
    started = start_pair(MEMORY)
    yield started
    started.client.stop()
    started.server.stop()


def open_room(pair: Pair, case: Case):
    sender = pair.server.sender(case.room)
    receiver = pair.client.receiver(
        case.room, "127.0.0.1", pair.server.port, list(case.decode_pages)
    )
    wait_until(lambda: sender.poll() is TransferState.WAITING_FOR_INPUT, "the request", 10)
    return sender, receiver


def piece(case: Case, span: PageSpan) -> OutgoingPiece:
    pages = list(case.prefill_pages)
    kv = KVStager(pools(case, 20, seed=case.room)).gather(span.page_lists(pages, pages, 1))
    return OutgoingPiece(span, kv)


def test_a_prefill_abort_mid_transfer_wins_and_leaves_the_registry_empty(pair):
    case = Case(room=10)
    sender, receiver = open_room(pair, case)
    gate = threading.Event()
    pair.client.io.call(lambda: gate.wait(10))  # NOTE: decode reads nothing meanwhile
    sender.send_piece(piece(case, PageSpan(0, 1)))
    sender.send_piece(piece(case, PageSpan(1, 1)))
    wait_until(lambda: len(REGISTRY) == 2, "both pieces to be registered", 10)
    sender.abort(FailureKind.INTERNAL, "the prefill step failed")
    wait_until(lambda: sender.poll() is TransferState.FAILED, "the abort", 10)
    # NOTE: the prefill's tick withdraws the ended room's bytes; decode has not read a thing.
    instance = pair.server.instance
    wait_until(lambda: REGISTRY.holding(instance) == 0, "prefill to withdraw the pieces", 10)
    assert len(REGISTRY) == 2  # their markers, until decode reads the announcements
    gate.set()
    wait_until(lambda: receiver.poll() is TransferState.FAILED, "decode to learn of it", 10)
    assert receiver.failure.kind is FailureKind.ABORTED
    assert "prefill: the prefill step failed" in receiver.failure.message
    wait_until(lambda: len(REGISTRY) == 0, "the registry to empty", 10)
    pair.transfer(Case(room=11))  # the pair stays usable


def test_a_decode_abort_mid_transfer_leaves_the_registry_empty(pair):
    case = Case(room=20)
    sender, receiver = open_room(pair, case)
    gate = threading.Event()
    pair.client.io.call(lambda: gate.wait(10))
    sender.send_piece(piece(case, PageSpan(0, 1)))
    wait_until(lambda: len(REGISTRY) == 1, "the piece to be registered", 10)
    receiver.abort(FailureKind.ABORTED, "the client left")
    gate.set()
    wait_until(lambda: sender.poll() is TransferState.FAILED, "prefill to learn of it", 10)
    sender.send_piece(piece(case, PageSpan(1, 1)))  # too late: the room ended
    wait_until(lambda: len(REGISTRY) == 0, "the registry to empty", 10)
    assert receiver.failure.kind is FailureKind.ABORTED
    pair.transfer(Case(room=21))


def test_a_piece_the_registry_does_not_hold_fails_the_room(pair):
    case = Case(room=30)
    sender, receiver = open_room(pair, case)
    server = pair.server
    forged = KVPiece(30, 0, 0, 1, 0, 0, pair.stager.page_bytes[0])
    server.io.call(lambda: server.send(sender.peer, forged))
    wait_until(lambda: receiver.poll() is TransferState.FAILED, "the check", 10)
    assert receiver.failure.kind is FailureKind.TRANSFER
    assert "prefill registered no such piece" in receiver.failure.message
    wait_until(lambda: sender.poll() is TransferState.FAILED, "prefill to learn of it", 10)


def test_a_full_registry_fails_the_room_with_the_reason(pair, monkeypatch):
    case = Case(room=40)
    sender, receiver = open_room(pair, case)
    monkeypatch.setattr(REGISTRY, "capacity", 0)
    sender.send_piece(piece(case, PageSpan(0, 1)))
    wait_until(lambda: receiver.poll() is TransferState.FAILED, "the refusal", 10)
    assert sender.failure.kind is FailureKind.TRANSFER
    assert "in-process KV registry is full" in receiver.failure.message


@pytest.mark.parametrize(
    "change, expected",
    [
        # decode sees a prefill worker of another process (at its HelloReply)
        (lambda p: setattr(p.client.plane, "process", ("elsewhere", 1)), "inside one process"),
        # prefill sees a decode worker of another process (at its Register)
        (
            lambda p: (
                setattr(p.server.plane, "process", ("elsewhere", 1)),
                setattr(p.client.plane, "other_process", lambda host, pid: None),
            ),
            "inside one process",
        ),
        # a prefill instance this process's registry does not know
        (lambda p: REGISTRY.close_sender(p.server.instance), "has no memory plane in this"),
    ],
)
def test_a_pair_not_in_one_process_is_refused_at_the_handshake(change, expected):
    started = start_pair(MEMORY)
    try:
        change(started)
        receiver = started.client.receiver(40, "127.0.0.1", started.server.port, [0, 7, 3])
        wait_until(lambda: receiver.poll() is TransferState.FAILED, "the refusal", 10)
        assert receiver.failure.kind is FailureKind.HANDSHAKE
        assert "handshake failed" in receiver.failure.message
        assert expected in receiver.failure.message
    finally:
        started.client.stop()
        started.server.stop()
