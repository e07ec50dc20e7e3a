"""What a hostile decode peer can do to a prefill worker's transfer endpoint, both sides in
one process on loopback: race its engine thread on the tombstones, fill its peer table, flood
it with rooms (its bootstrap port's connections: test_transfer_bootstrap_connections)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import socket
import sys
import threading
import time

import pytest
import zmq

from pdserve.protocol.codec import decode, encode
from pdserve.protocol.failures import Failure, FailureKind, FailureStage
from pdserve.protocol.transfer_messages import (
    AbortRoom,
    Heartbeat,
    Hello,
    HelloReply,
    Register,
    RegisterAck,
    RegisterRejected,
    TransferRequest,
)
from pdserve.transfer.kv_staging import KVStager
from pdserve.transfer.peer_auth import decode_proof, new_nonce
from pdserve.transfer.prefill_side import PrefillTransferServer
from pdserve.transfer.room_state import Tombstones, TransferState
from tests.e2e.transfer_peers import layout, metadata_spec, pools, record
from tests.unit.transfer.test_transfer_hardening import (
    CASE,
    authenticated_dealer,
    finished,
    receive,
)
from tests.unit.transfer.test_transfer_in_process import CONFIG, Case, start_pair
from tests.waiting import wait_until

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


@pytest.fixture
def zmq_context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def fast_thread_switches():
    """Switch threads as often as the interpreter can, so that a race shows in a second."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


# ---- the tombstones, used by the engine thread and the IO thread ---------------------------


def test_tombstones_survive_two_threads_adding_and_expiring_at_once(fast_thread_switches):
    tombstones = Tombstones(ttl_s=1e-4, capacity=64)
    errors: list[BaseException] = []
    done = threading.Event()

    def hammer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(40_000):
                room = rng.randrange(1_000)
                tombstones.add(room)
                _ = room in tombstones
                tombstones.failure(room)
                if done.is_set():
                    return
        except Exception as e:  # NOTE: what the race raises is what the test checks
            errors.append(e)
            done.set()

    threads = [threading.Thread(target=hammer, args=(seed,)) for seed in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert len(tombstones) <= 64


def test_engine_thread_rooms_and_io_thread_aborts_race_without_killing_either(
    zmq_context, fast_thread_switches, caplog
):
    """The engine thread asks for rooms (`sender`, `release`) while a decode peer floods
    aborts and transfer requests for random rooms, with tombstones expiring all the time."""
    config = dataclasses.replace(CONFIG, tombstone_ttl_s=1e-4)
    pair = start_pair(config)
    server = pair.server
    caplog.set_level(logging.ERROR, logger="pdserve.transfer.io_thread")
    stop = threading.Event()
    try:
        raw = authenticated_dealer(zmq_context, server.port, "")
        failure = Failure(FailureKind.ABORTED, FailureStage.BOOTSTRAP, "the client left")

        def flood() -> None:
            rng = random.Random(1)
            while not stop.is_set():
                room = rng.randrange(1 << 12)
                raw.send(encode(AbortRoom(room, failure)))
                raw.send(encode(TransferRequest(room + (1 << 12), 2, 0)))

        flooder = threading.Thread(target=flood)
        flooder.start()
        rng = random.Random(2)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            room = rng.randrange(1 << 13)
            server.sender(room)
            server.release(room)
        stop.set()
        flooder.join(10)
        raw.close(0)
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        pair.transfer(Case(room=1 << 20))  # and the endpoint still works
    finally:
        stop.set()
        pair.client.stop()
        server.stop()


def test_a_tombstone_keeps_a_bounded_part_of_a_failure_message():
    tombstones = Tombstones(ttl_s=60, capacity=4)
    long = "x" * (1 << 20)  # a peer's AbortRoom may name any reason
    for room in range(10):
        tombstones.add(room, Failure(FailureKind.ABORTED, FailureStage.BOOTSTRAP, long))
    kept = [tombstones.failure(room) for room in range(6, 10)]
    assert len(tombstones) == 4
    assert all(f is not None and 0 < len(f.message) <= 256 for f in kept)


# ---- the peer table ------------------------------------------------------------------------


def dealer_from(context, host: str, port: int) -> zmq.Socket:
    """A raw connection to the bootstrap port from source address `host` (a 127/8 alias)."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"tcp://{host}:0;127.0.0.1:{port}")
    return socket


def registered_fakes(context, port: int, count: int, source: str = "127.0.0.1") -> list:
    fakes = [authenticated_dealer(context, port, "", source) for _ in range(count)]
    for fake in fakes:  # they keep heartbeating, as live decode workers would
        fake.send(encode(Heartbeat("fake")))
        decode(receive(fake)[0], Heartbeat)
    return fakes


def test_idle_registered_peers_give_way_to_a_restarted_decode_worker(zmq_context):
    config = dataclasses.replace(CONFIG, max_peers=4)
    pair = start_pair(config)
    try:
        fakes = registered_fakes(zmq_context, pair.server.port, config.max_peers)
        assert len(pair.server.peers) == config.max_peers
        pair.transfer(Case(room=5))
        assert len(pair.server.peers) <= config.max_peers
        for fake in fakes:
            fake.close(0)
    finally:
        pair.client.stop()
        pair.server.stop()


def busy_fakes(context, server, rooms: list[int], source: str = "127.0.0.1") -> list:
    """Registered peers each serving one room of this worker's own requests."""
    fakes = registered_fakes(context, server.port, len(rooms), source)
    for fake, room in zip(fakes, rooms, strict=True):
        sender = server.sender(room)
        fake.send(encode(TransferRequest(room, 2, 0)))
        wait_until(lambda s=sender: s.poll() is TransferState.WAITING_FOR_INPUT, "the room", 10)
    return fakes


def test_a_full_table_of_busy_peers_refuses_a_new_one_by_name(zmq_context):
    config = dataclasses.replace(CONFIG, max_peers=2)
    pair = start_pair(config)
    try:
        fakes = busy_fakes(zmq_context, pair.server, [31, 32])
        receiver = pair.client.receiver(33, "127.0.0.1", pair.server.port, [1, 2])
        wait_until(lambda: finished(receiver), "decode's room to fail", 10)
        failure = receiver.failure
        assert failure.kind is FailureKind.HANDSHAKE, failure
        assert "prefill p refused the connection" in failure.message
        assert "peer table is full (2 decode peers" in failure.message
        for fake in fakes:
            fake.close(0)
    finally:
        pair.client.stop()
        pair.server.stop()


def test_one_host_holds_at_most_its_share_of_the_peer_table(zmq_context):
    config = dataclasses.replace(CONFIG, max_peers=8, max_peers_per_host=2)
    pair = start_pair(config)
    try:
        fakes = busy_fakes(zmq_context, pair.server, [41, 42], source="127.0.0.2")
        extra = dealer_from(zmq_context, "127.0.0.2", pair.server.port)
        extra.send(encode(Hello("fake", new_nonce())))
        refusal = decode(receive(extra)[0], RegisterRejected)
        assert "2 decode peers from 127.0.0.2 serve rooms (limit 2 a host)" in refusal.reason
        pair.transfer(Case(room=43))  # another host still gets in
        for fake in [*fakes, extra]:
            fake.close(0)
    finally:
        pair.client.stop()
        pair.server.stop()


# ---- rooms a peer asks for, whose prefill request never comes ---------------------------------


def flood_rooms(socket: zmq.Socket, first: int, count: int) -> int:
    """Ask for `count` rooms nobody prefills; return how many were refused (once a heartbeat
    sent after them is answered, every one was handled: one connection is handled in order)."""
    for room in range(first, first + count):
        socket.send(encode(TransferRequest(room, 2, 0)))
    socket.send(encode(Heartbeat("flood")))
    refused = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        frame = receive(socket)[0]
        with contextlib.suppress(ValueError):
            decode(frame, Heartbeat)
            return refused
        msg = decode(frame, AbortRoom)
        assert "wait for their prefill request (limit" in msg.failure.message
        refused += 1
    raise TimeoutError("the flood was not handled in time")


def test_rooms_waiting_for_their_prefill_request_are_bounded_per_peer_and_in_all(zmq_context):
    config = dataclasses.replace(CONFIG, max_waiting_rooms_per_peer=50, max_waiting_rooms=80)
    pair = start_pair(config)
    server = pair.server
    try:
        first, second = (authenticated_dealer(zmq_context, server.port, "") for _ in range(2))
        assert flood_rooms(first, 1_000, 2_000) == 2_000 - 50
        assert len(server.rooms) == 50
        pair.transfer(Case(room=7))  # a real room still gets through
        assert flood_rooms(second, 10_000, 2_000) == 2_000 - 30
        assert len(server.rooms) <= 80 + 1  # NOTE: + the real room, until its release
        # A refused room's prefill request, should it come, fails at once with the reason.
        late = server.sender(1_999)
        assert late.poll() is TransferState.FAILED and "limit 50 a peer" in late.failure.message
        first.close(0)
        second.close(0)
    finally:
        pair.client.stop()
        server.stop()


# ---- a torch.distributed link that is never made ----------------------------------------------


def test_sends_for_a_link_never_made_stop_counting_when_the_peer_is_dropped(zmq_context):
    """A decode peer (gloo) names a store that never answers: prefill's link stays in the
    making, the piece's send waits for it, and when the silent peer is dropped its sends go
    with it."""
    config = dataclasses.replace(CONFIG, backend="gloo", peer_timeout_s=1)
    pair = start_pair(config)
    server = pair.server
    silent_store = socket.create_server(("127.0.0.1", 0))
    try:
        nonce = new_nonce()
        raw = dealer_from(zmq_context, "127.0.0.1", server.port)
        raw.send(encode(Hello("raw-decode", nonce)))
        reply = decode(receive(raw)[0], HelloReply)
        store = f"127.0.0.1:{silent_store.getsockname()[1]}"
        register = Register(
            "raw-decode",
            layout(CASE),
            decode_proof("", reply.nonce, nonce),
            backend="gloo",
            store_address=store,
            pair_name="pair/never",
        )
        raw.send(encode(register))
        decode(receive(raw)[0], RegisterAck)
        sender = server.sender(61)
        raw.send(encode(TransferRequest(61, len(CASE.decode_pages), 0)))
        wait_until(lambda: sender.poll() is TransferState.WAITING_FOR_INPUT, "the request", 10)
        kv = KVStager(pools(CASE, 20, seed=1)).gather([list(CASE.prefill_pages)])
        sender.send(kv, record(CASE))
        wait_until(lambda: server.pending_sends == 1, "the send to be posted", 10)
        wait_until(lambda: finished(sender), "the silent peer to be dropped", 10)
        assert server.pending_sends == 0
        raw.close(0)
    finally:
        silent_store.close()
        pair.client.stop()
        server.stop()


# ---- secure by default -------------------------------------------------------------------------


@pytest.mark.parametrize("token", ["", "s3cret"])
def test_a_prefill_worker_without_a_token_warns_once_at_start_up(caplog, token):
    caplog.set_level(logging.WARNING, logger="pdserve.transfer.prefill_side")
    config = dataclasses.replace(CONFIG, auth_token=token)
    server = PrefillTransferServer(config, layout(CASE), metadata_spec(CASE), "p")
    server.start()
    server.stop()
    warned = [r.getMessage() for r in caplog.records if "transfer token" in r.getMessage()]
    if token:
        assert warned == []
    else:
        assert len(warned) == 1
        assert f"bootstrap port 127.0.0.1:{server.port}" in warned[0]
        assert "--transfer-token" in warned[0]


def test_a_registered_peer_that_greets_again_loses_its_rooms_at_once(zmq_context):
    """Its rooms would otherwise stay with an entry nobody can reach until their deadline."""
    pair = start_pair(CONFIG)
    try:
        (fake,) = busy_fakes(zmq_context, pair.server, [41])
        sender = pair.server.sender(41)
        fake.send(encode(Hello("raw-decode", new_nonce())))
        decode(receive(fake)[0], HelloReply)  # a fresh handshake is under way
        wait_until(lambda: sender.poll() is TransferState.FAILED, "the room to fail", 5)
        assert sender.failure.kind is FailureKind.PEER_LOST
        assert "greeted again after it registered" in sender.failure.message
        assert len(pair.server.peers) == 1 and not pair.server.live_rooms(
            next(iter(pair.server.peers.values()))
        )
        fake.close(0)
    finally:
        pair.client.stop()
        pair.server.stop()


def test_a_registered_peer_whose_next_register_fails_its_proof_loses_its_rooms_at_once(
    zmq_context,
):
    pair = start_pair(CONFIG)
    try:
        (fake,) = busy_fakes(zmq_context, pair.server, [42])
        sender = pair.server.sender(42)
        fake.send(encode(Register("raw-decode", layout(CASE), b"\0" * 32)))
        decode(receive(fake)[0], RegisterRejected)
        wait_until(lambda: sender.poll() is TransferState.FAILED, "the room to fail", 5)
        assert sender.failure.kind is FailureKind.HANDSHAKE
        assert "authentication failed" in sender.failure.message
        assert not pair.server.peers
        fake.close(0)
    finally:
        pair.client.stop()
        pair.server.stop()
