"""The `ipc` backend's announcement lane (`ipc_lane`): messages from prefill's worker thread to
decode's IO thread over a connection the kernel tells decode the sender's process of; what
decode does with packets that are malformed, too large, or from a process it did not register
with; a lane that fills, and the fallback to the connection where no lane can be had."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import select
import socket
import threading
import time

import pytest
import zmq

from pdserve.protocol.codec import encode
from pdserve.protocol.metadata_spec import MetadataSpec
from pdserve.protocol.transfer_messages import (
    KVPiece,
    MetadataHeader,
    Register,
    RoomAck,
    RoomDone,
)
from pdserve.transfer.backends.ipc.ipc_lane import (
    LANE_PREFIX,
    MAX_PACKET,
    LaneReceiver,
    LaneSender,
    lane_address_problem,
    lane_fits,
)
from pdserve.transfer.backends.ipc.ipc_lane import _parse as parse_packet
from pdserve.transfer.endpoint import Endpoint
from pdserve.transfer.kv_piece import PageSpan
from pdserve.transfer.room_state import TransferState
from tests.e2e.transfer_peers import Case, record
from tests.unit.transfer.backends import test_transfer_ipc
from tests.unit.transfer.backends.test_transfer_ipc import (
    assert_written,
    open_room,
    start_ipc_pair,
    write_piece,
)
from tests.waiting import wait_until

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


PIECE = KVPiece(7, 0, 0, 2, 0, 0, 1024)
pair = test_transfer_ipc.pair  # the fixture: a prefill and a decode endpoint over ipc


@pytest.fixture
def lane():
    poller = zmq.Poller()
    receiver = LaneReceiver(poller, wanted=lambda pid: pid == os.getpid())
    sender = LaneSender(receiver.address, wait_s=0.2)
    yield poller, receiver, sender
    sender.close()
    receiver.close()


def received(poller: zmq.Poller, receiver: LaneReceiver, count: int) -> list:
    """`count` results off the lane, reading as the IO thread does (5 s at most)."""
    out, deadline = [], time.monotonic() + 5
    while len(out) < count:
        assert time.monotonic() < deadline, f"{len(out)} of {count} packets within 5 s"
        for fd, _ in poller.poll(100):
            assert receiver.owns(fd)
            out += receiver.read(fd)
    return out


def test_messages_arrive_in_order_with_their_payload_and_the_senders_process(lane):
    poller, receiver, sender = lane
    header = MetadataHeader(7, first_token=42, cached_tokens=0, topk=1)
    for msg, payload in ((PIECE, b""), (header, b"\x01" * 12), (RoomDone(7, 1024, 1), b"")):
        assert sender.send(msg, payload) is None
    assert received(poller, receiver, 3) == [
        (os.getpid(), PIECE, None),
        (os.getpid(), header, b"\x01" * 12),
        (os.getpid(), RoomDone(7, 1024, 1), None),
    ]


def frame(body: bytes, payload: bytes = b"", *, payload_length: int | None = None) -> bytes:
    """One message as a packet carries it (lengths of body and payload, then both)."""
    size = len(payload) if payload_length is None else payload_length
    return len(body).to_bytes(4, "little") + size.to_bytes(4, "little") + body + payload


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"\x01", "a message of 1 bytes in a packet"),
        (frame(b"x" * 99)[:12], "a 99+0-byte message in a packet of 12 bytes"),
        (frame(b"", payload_length=1 << 31), "message in a packet"),
        (frame(b"abc"), "message"),
        (frame(encode(RoomAck(7))), "room_ack"),
        (frame(encode(PIECE), b"xx"), "with a payload"),
        (frame(encode(PIECE)) + b"\x00" * 3, "a message of 3 bytes in a packet"),
        (b"\x00" * (MAX_PACKET + 1), f"over {MAX_PACKET} bytes"),
    ],
    ids=[
        "short",
        "overrun",
        "payload-overrun",
        "garbage",
        "not-a-lane-message",
        "payload",
        "trailing",
        "oversize",
    ],
)
def test_a_malformed_packet_is_reported_with_what_is_wrong(lane, data, problem):
    poller, receiver, _ = lane
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as raw:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MAX_PACKET)
        raw.connect(receiver.address)
        raw.send(data)
        raw.send(frame(encode(PIECE)))  # NOTE: the next packet is read on its own
        trailing = problem.startswith("a message of 3")
        results = received(poller, receiver, 3 if trailing else 2)
    *before, (pid, reported), after = results
    assert pid == os.getpid() and problem in reported
    assert after == (os.getpid(), PIECE, None)
    # NOTE: a packet's messages before the fault are taken.
    assert before == ([(os.getpid(), PIECE, None)] if trailing else [])


def test_held_messages_go_in_one_packet_and_arrive_in_order():
    header = MetadataHeader(7, first_token=42, cached_tokens=0, topk=1)
    messages = [(PIECE, None), (header, b"\x01" * 12), (RoomDone(7, 1024, 1), None)]
    address = f"{LANE_PREFIX}test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(address)
        listener.listen(1)
        sender = LaneSender(address, wait_s=0.2)
        connection, _ = listener.accept()
        connection.settimeout(5)
        sender.hold()
        for msg, payload in messages:
            assert sender.send(msg, payload or b"") is None
        assert select.select([connection], [], [], 0)[0] == []  # NOTE: held: nothing sent
        assert sender.flush() is None
        assert parse_packet(connection.recv(MAX_PACKET)) == messages
        assert sender.send(PIECE) is None  # NOTE: no longer held: a packet of its own
        assert parse_packet(connection.recv(MAX_PACKET)) == [(PIECE, None)]
        sender.close()
        connection.close()


def test_held_messages_beyond_a_packet_go_in_as_many_as_they_need(lane):
    poller, receiver, sender = lane
    header = MetadataHeader(7, first_token=42, cached_tokens=0)
    payload = b"\x02" * (MAX_PACKET // 3)
    sender.hold()
    for _ in range(5):
        assert sender.send(header, payload) is None
    assert sender.flush() is None
    assert [msg for _, msg, _ in received(poller, receiver, 5)] == [header] * 5


def test_a_send_that_cannot_go_says_why_and_waits_no_longer_than_its_deadline(lane):
    _, receiver, sender = lane
    too_big = MetadataHeader(7, 1, 0)
    assert "does not fit the lane" in sender.send(too_big, b"\x00" * MAX_PACKET)
    problem, sent, started = None, 0, time.monotonic()
    while problem is None and sent < 100_000:  # nobody reads: the connection fills
        problem = sender.send(PIECE)
        sent += 1
    assert problem == "decode took no announcement for 200 ms" and sent > 100
    assert time.monotonic() - started < 5
    receiver.close()
    assert "decode's announcement lane failed" in sender.send(PIECE)
    sender.close()
    assert sender.send(PIECE) == "the connection to decode was dropped"


@pytest.mark.parametrize("why", ["another process", "past the limit"])
def test_a_connection_not_wanted_is_closed_as_it_comes_and_a_closed_one_let_go(why):
    poller, results = zmq.Poller(), []
    wanted = (lambda pid: pid == os.getpid() + 1) if why == "another process" else None
    receiver = LaneReceiver(poller, wanted or (lambda pid: True), max_connections=1)

    def descriptors_polled() -> int:
        """Read what is ready, as the IO thread does; how many descriptors it then polls."""
        results.extend(r for fd, _ in poller.poll(10) for r in receiver.read(fd))
        return len(poller.sockets)

    first = LaneSender(receiver.address, wait_s=0.2)
    second = LaneSender(receiver.address, wait_s=0.2) if wanted is None else first
    try:
        kept = 1 if wanted else 2  # the listener, and the first connection unless refused
        wait_until(lambda: descriptors_polled() == kept and results, "a refusal", 5)
        assert results == [(os.getpid(), f"a lane connection refused ({kept - 1} open)")]
        assert "lane failed" in second.send(PIECE)  # it was closed
        if wanted is None:
            first.close()
            wait_until(lambda: descriptors_polled() == 1, "the closed connection let go", 5)
    finally:
        first.close()
        second.close()
        receiver.close()
    assert poller.sockets == []


def test_only_lane_addresses_are_taken_and_large_metadata_goes_over_the_connection():
    assert lane_address_problem("\0pdserve-lane-ab") is None
    assert "not a pdserve lane address" in lane_address_problem("/tmp/some.sock")
    assert "not a pdserve lane address" in lane_address_problem("\0pdserve-lane-" + "a" * 100)
    assert lane_fits(MetadataSpec(topk=8, hidden_size=4096, hidden_dtype="bfloat16").nbytes)
    assert not lane_fits(MetadataSpec(topk=8, hidden_size=32768, hidden_dtype="float32").nbytes)
    with pytest.raises(OSError):
        LaneSender("\0pdserve-lane-nobody-listens", wait_s=1)


def test_pieces_and_the_finish_go_over_the_lane_not_the_io_thread(pair, monkeypatch):
    sent = []  # (message type, the way, the sending thread) of every send of either side
    for cls, way in ((Endpoint, "connection"), (LaneSender, "lane")):

        def recorded(self, *args, send=cls.send, way=way, **kwargs):
            msg = args[1] if way == "connection" else args[0]
            sent.append((type(msg).__name__, way, threading.current_thread()))
            return send(self, *args, **kwargs)

        monkeypatch.setattr(cls, "send", recorded)
    packets = []  # the messages in each packet the lane sent
    send_packet = LaneSender._send
    monkeypatch.setattr(
        LaneSender,
        "_send",
        lambda self, packet: packets.append(parse_packet(packet)) or send_packet(self, packet),
    )
    case = Case(room=70, draft=True)
    sender, receiver = open_room(pair, case)
    assert pair.server.plane.decode_of(sender.peer).lane is not None
    write_piece(pair, sender, case, PageSpan(0, 2))
    write_piece(pair, sender, case, PageSpan(2, 1, 0, 3), then=record(case))
    wait_until(lambda: receiver.poll() is TransferState.SUCCESS, "the room", 20)
    wait_until(lambda: sender.poll() is TransferState.SUCCESS, "the ack", 20)
    receiver.commit(pair.target)
    assert_written(pair, case)
    assert pair.client.metrics.malformed_messages == 0
    here = threading.current_thread()
    lane = [(kind, thread is here) for kind, way, thread in sent if way == "lane"]
    assert lane == [
        ("KVPiece", True),
        ("KVPiece", True),
        ("MetadataHeader", True),
        ("RoomDone", True),
    ]
    # NOTE: the last piece, the metadata record and RoomDone in one packet.
    kinds = [[type(msg).__name__ for msg, _ in packet] for packet in packets]
    assert kinds == [["KVPiece"], ["KVPiece", "MetadataHeader", "RoomDone"]]
    on_the_connection = {kind for kind, way, _ in sent if way == "connection"}
    assert "RoomAck" in on_the_connection  # decode's, the other way
    assert not on_the_connection & {"KVPiece", "MetadataHeader", "RoomDone"}
    # The step that splits the lane's hop from decode's handling of the first piece.
    assert receiver.stamps["lane_read"] <= receiver.stamps["first_piece"]


def _forge(address: str, room: int) -> None:
    sender = LaneSender(address, wait_s=1)
    sender.send(KVPiece(room, 0, 0, 2, 0, 0, 2048))
    sender.close()


def test_an_announcement_from_another_process_is_dropped(pair):
    case = Case(room=71, draft=True)
    sender, receiver = open_room(pair, case)
    child = multiprocessing.get_context("fork").Process(
        target=_forge, args=(pair.client.plane.lane.address, case.room)
    )
    child.start()
    child.join(10)
    assert child.exitcode == 0
    wait_until(lambda: pair.client.metrics.malformed_messages == 1, "the forgery to be seen", 10)
    assert receiver.poll() is TransferState.BOOTSTRAPPING  # nothing was announced
    write_piece(pair, sender, case, PageSpan(0, 3, 0, 3))
    sender.finish(record(case))
    wait_until(lambda: receiver.poll() is TransferState.SUCCESS, "the room", 20)
    receiver.commit(pair.target)
    assert_written(pair, case)


@pytest.mark.parametrize("why", ["metadata too large", "lane unreachable"])
def test_without_a_lane_announcements_go_over_the_connection(monkeypatch, why):
    if why == "metadata too large":
        monkeypatch.setattr(
            "pdserve.transfer.backends.ipc.ipc_receive_plane.lane_fits", lambda nbytes: False
        )
    pair = start_ipc_pair()
    try:
        if why == "lane unreachable":  # as from another network namespace: nobody there
            pair.client.plane.lane.address = LANE_PREFIX + "nobody-listens"
        case = Case(room=72, draft=True)
        sender, receiver = open_room(pair, case)
        assert pair.server.plane.decode_of(sender.peer).lane is None
        write_piece(pair, sender, case, PageSpan(0, 3, 0, 3))
        sender.finish(record(case))
        wait_until(lambda: receiver.poll() is TransferState.SUCCESS, "the room", 20)
        receiver.commit(pair.target)
        assert_written(pair, case)
        assert pair.client.metrics.malformed_messages == 0
        assert "lane_read" not in receiver.stamps
    finally:
        pair.client.stop()
        pair.server.stop()


def test_a_register_naming_a_foreign_socket_as_its_lane_is_refused(pair):
    sender, _ = open_room(pair, Case(room=73, draft=True))
    ours = pair.client.plane.registration(None, Register("d", pair.client.layout))
    forged = dataclasses.replace(ours, lane="/run/docker.sock")
    assert "not a pdserve lane address" in pair.server.plane.register_problem(sender.peer, forged)
