"""What a restarted, slow or hostile peer can do to the transfer layer, both sides in one
process on loopback: a prefill restart on the same port, hosts outside the allow list, the
token never on the wire, oversize frames, floods, stuck peers, and queue time vs deadlines."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import pytest
import torch
import zmq

from pdserve.protocol.codec import decode, encode
from pdserve.protocol.failures import FailureKind
from pdserve.protocol.transfer_messages import (
    Hello,
    HelloReply,
    KVPiece,
    Register,
    RegisterAck,
    TransferRequest,
)
from pdserve.transfer.decode_side import DecodeTransferClient
from pdserve.transfer.kv_staging import KVStager
from pdserve.transfer.peer_allow import PeerNotAllowed
from pdserve.transfer.peer_auth import decode_proof, new_nonce
from pdserve.transfer.prefill_side import PrefillTransferServer
from pdserve.transfer.room_state import TransferState
from pdserve.transfer.wire_limits import MAX_DECODE_MESSAGE_BYTES
from tests.e2e.transfer_peers import Case, layout, metadata_spec, pools, record
from tests.unit.transfer.test_transfer_in_process import CONFIG, start_pair
from tests.waiting import wait_until

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


CASE = Case(room=1)
TOKEN = "tr4nsfer-s3cret-token"
DONE = (TransferState.SUCCESS, TransferState.FAILED)


def finished(handle) -> bool:
    return handle.poll() in DONE


@pytest.fixture
def zmq_context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def receive(socket: zmq.Socket, timeout_s: float = 5.0) -> list[bytes]:
    if not socket.poll(int(timeout_s * 1000)):
        raise TimeoutError("no message from the peer")
    return socket.recv_multipart()


def authenticated_dealer(context, port: int, token: str, source: str = "") -> zmq.Socket:
    """A raw decode connection that completes the handshake as a legitimate decode would
    (from address `source`, a 127/8 alias, if given)."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"tcp://{source}:0;127.0.0.1:{port}" if source else f"tcp://127.0.0.1:{port}")
    nonce = new_nonce()
    socket.send(encode(Hello("raw-decode", nonce)))
    reply = decode(receive(socket)[0], HelloReply)
    proof = decode_proof(token, reply.nonce, nonce)
    socket.send(encode(Register("raw-decode", layout(CASE), proof)))
    decode(receive(socket)[0], RegisterAck)
    return socket


def test_decode_keeps_working_after_prefill_restarts_on_the_same_port():
    pair = start_pair(CONFIG)
    try:
        pair.transfer(Case(room=1))
        port = pair.server.port
        # A room in flight with the old prefill process: it must fail, not hang.
        stranded = pair.client.receiver(3, "127.0.0.1", port, [7, 8, 9])
        wait_until(
            lambda: pair.server.sender(3).poll() is TransferState.WAITING_FOR_INPUT,
            "the stranded room's request",
        )
        pair.server.stop()
        restarted = dataclasses.replace(CONFIG, bootstrap_port=port)
        pair.server = PrefillTransferServer(restarted, layout(CASE), metadata_spec(CASE), "p2")
        pair.server.start()
        pair.transfer(Case(room=2))
        wait_until(lambda: finished(stranded), "the stranded room to fail", 10)
        assert stranded.poll() is TransferState.FAILED
        assert stranded.failure.kind is FailureKind.PEER_LOST
        assert "restarted" in stranded.failure.message or "silent" in stranded.failure.message
    finally:
        pair.client.stop()
        pair.server.stop()


def test_a_host_outside_the_allow_list_is_never_contacted(zmq_context):
    listener = zmq_context.socket(zmq.ROUTER)
    port = listener.bind_to_random_port("tcp://127.0.0.2")
    config = dataclasses.replace(CONFIG, auth_token=TOKEN, bootstrap_allow=("127.0.0.1/32",))
    pair = start_pair(config)
    try:
        with pytest.raises(PeerNotAllowed, match=r"127\.0\.0\.2"):
            pair.client.receiver(5, "127.0.0.2", port, [1, 2])
        with pytest.raises(PeerNotAllowed):
            pair.client.abort_room(6, "127.0.0.2", port, FailureKind.INVALID, "refused")
        pair.transfer(Case(room=7))  # the allowed prefill still works
        assert not listener.poll(200)
        assert all("127.0.0.2" not in address for address in pair.client.peers)
    finally:
        pair.client.stop()
        pair.server.stop()
        listener.close(0)


def test_a_fake_prefill_never_sees_the_token_and_its_socket_is_closed(zmq_context):
    fake = zmq_context.socket(zmq.ROUTER)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    pair = start_pair(dataclasses.replace(CONFIG, auth_token=TOKEN))
    try:
        receiver = pair.client.receiver(8, "127.0.0.1", port, [1, 2])
        identity, hello = receive(fake)
        received = [hello]
        # It cannot prove the token: any answer is wrong.
        nonce = new_nonce()
        fake.send_multipart([identity, encode(HelloReply("fake", 1, nonce, b"\x00" * 32))])
        wait_until(lambda: finished(receiver), "the room to fail", 5)
        while fake.poll(300):
            received.append(fake.recv_multipart()[-1])
        assert all(TOKEN.encode() not in frame for frame in received)
        assert len(received) == 1 and decode(hello, Hello).decode_id == "d"
        assert receiver.failure.kind is FailureKind.HANDSHAKE
        assert "authentication failed" in receiver.failure.message
        wait_until(lambda: not pair.client.peers, "the peer to be closed", 5)
    finally:
        pair.client.stop()
        pair.server.stop()
        fake.close(0)


def test_a_frame_over_the_size_limit_is_dropped_before_it_is_buffered(zmq_context):
    pair = start_pair(CONFIG)
    try:
        limit = pair.server.channel.socket.getsockopt(zmq.MAXMSGSIZE)
        assert limit == MAX_DECODE_MESSAGE_BYTES < 8 << 20
        payload = bytes(256 << 20)
        rss_before = _rss_bytes()
        rogue = zmq_context.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(f"tcp://127.0.0.1:{pair.server.port}")
        rogue.send(payload, copy=False)
        del payload
        pair.transfer(Case(room=9))  # still serving
        assert _rss_bytes() - rss_before < 128 << 20
        assert pair.server.metrics.malformed_messages == 0
        rogue.close(0)
    finally:
        pair.client.stop()
        pair.server.stop()


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_wrong_token_flood_leaves_no_rooms_and_bounded_peers(zmq_context):
    config = dataclasses.replace(CONFIG, auth_token=TOKEN, max_peers=4)
    pair = start_pair(config)
    server = pair.server
    try:
        sockets = []
        for _ in range(10):  # more connections than the peer limit
            socket = zmq_context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(f"tcp://127.0.0.1:{server.port}")
            socket.send(encode(Hello("flood", new_nonce())))
            sockets.append(socket)
        flood = sockets[-1]
        wrong = Register("flood", layout(CASE), b"\x01" * 32)
        for room in range(20_000):
            flood.send(encode(TransferRequest(room, 3, 0)))
            if room % 1000 == 0:
                flood.send(encode(wrong))
        # Messages on one connection are handled in order: once this answers, all were seen.
        probe = authenticated_dealer(zmq_context, server.port, TOKEN)
        flood.send(encode(Hello("flood", new_nonce())))
        wait_until(lambda: _drain_for(flood, HelloReply), "the flood to be handled", 20)
        assert len(server.rooms) == 0 and len(server.tombstones) == 0
        assert len(server.peers) <= config.max_peers
        probe.close(0)
        for socket in sockets:
            socket.close(0)
        pair.transfer(Case(room=11))
    finally:
        pair.client.stop()
        pair.server.stop()


def _drain_for(socket: zmq.Socket, kind) -> bool:
    """Read what arrived; True once a message of `kind` was among it."""
    while socket.poll(10):
        if _is(socket.recv_multipart()[0], kind):
            return True
    return False


def _is(frame: bytes, kind) -> bool:
    try:
        decode(frame, kind)
    except ValueError:
        return False
    return True


def test_a_transfer_request_for_too_many_pages_is_refused_before_any_room(zmq_context):
    pair = start_pair(CONFIG)
    try:
        raw = authenticated_dealer(zmq_context, pair.server.port, "")
        raw.send(encode(TransferRequest(12, pair.server.max_room_pages + 1, 0)))
        reply = decode(receive(raw)[0])
        assert "exceeds" in reply.failure.message
        assert pair.server.sender(12).poll() is TransferState.FAILED
        assert reply.failure.kind is FailureKind.INVALID  # decode answers 400, not 503
        raw.close(0)
    finally:
        pair.client.stop()
        pair.server.stop()


@pytest.mark.parametrize("num_cached", [3, 4, -1])
def test_a_transfer_request_that_would_skip_every_page_is_refused(zmq_context, num_cached):
    """Decode may skip the pages its cache holds, never the last one (nor a negative count)."""
    pair = start_pair(CONFIG)
    try:
        raw = authenticated_dealer(zmq_context, pair.server.port, "")
        raw.send(encode(TransferRequest(13, 3, 0, num_cached)))
        reply = decode(receive(raw)[0])
        assert f"skips {num_cached} cached pages of a room of 3" in reply.failure.message
        assert pair.server.sender(13).poll() is TransferState.FAILED
        raw.close(0)
    finally:
        pair.client.stop()
        pair.server.stop()


def test_a_decode_peer_that_stops_reading_does_not_delay_a_healthy_one(zmq_context):
    config = dataclasses.replace(CONFIG, chunk_bytes=1 << 10, peer_timeout_s=1)
    pair = start_pair(config)
    server = pair.server
    try:
        stuck = authenticated_dealer(zmq_context, server.port, "")
        stuck.send(encode(TransferRequest(20, 2, 0)))
        stuck_room = server.sender(20)
        wait_until(lambda: stuck_room.poll() is TransferState.WAITING_FOR_INPUT, "the stuck room")
        # 64k frames of 1 KiB for a peer that reads none of them.
        stuck_room.send(torch.zeros(64 << 20, dtype=torch.uint8), record(CASE))
        started = time.monotonic()
        pair.transfer(Case(room=21))
        assert time.monotonic() - started < config.send_timeout_s
        wait_until(lambda: finished(stuck_room), "the stuck peer to be dropped", 10)
        assert stuck_room.poll() is TransferState.FAILED
        stuck.close(0)
    finally:
        pair.client.stop()
        pair.server.stop()


def test_time_in_the_prefill_queue_does_not_count_against_the_progress_deadline():
    config = dataclasses.replace(CONFIG, progress_timeout_s=0.4, queue_timeout_s=30)
    pair = start_pair(config)
    try:
        sender = pair.server.sender(30)
        receiver = pair.client.receiver(30, "127.0.0.1", pair.server.port, [1, 2, 3])
        wait_until(lambda: sender.poll() is TransferState.WAITING_FOR_INPUT, "the request")
        time.sleep(1.0)  # NOTE: the point is that time passes: queued, not stalled
        assert sender.poll() is TransferState.WAITING_FOR_INPUT
        assert receiver.poll() is TransferState.BOOTSTRAPPING
        sender.started()  # compute begins; now the progress deadline counts
        wait_until(lambda: finished(sender), "the deadline", 5)
        assert sender.failure.kind is FailureKind.TIMEOUT and "timed out" in sender.failure.message
        wait_until(lambda: finished(receiver), "decode to learn of it", 5)
    finally:
        pair.client.stop()
        pair.server.stop()


def test_a_failed_room_frees_the_buffer_announced_to_its_peer():
    config = dataclasses.replace(CONFIG, backend="gloo", peer_timeout_s=1)
    pair = start_pair(config)
    server, client = pair.server, pair.client
    try:
        sender = server.sender(40)
        client.receiver(40, "127.0.0.1", server.port, list(CASE.decode_pages))
        wait_until(lambda: sender.poll() is TransferState.WAITING_FOR_INPUT, "the request", 20)
        # decode stalls: it takes the piece's announcement but never posts the receive
        client.plane.handle = lambda peer, msg, payload: isinstance(msg, KVPiece)
        kv = KVStager(pools(CASE, 20, seed=1)).gather([list(CASE.prefill_pages)])
        sender.send(kv, record(CASE))
        wait_until(lambda: server.pending_sends == 1, "the announcement", 10)
        client.stop()
        wait_until(lambda: server.pending_sends == 0, "the buffer to be released", 10)
        assert sender.poll() is TransferState.FAILED
    finally:
        server.stop()


def test_stopping_an_io_thread_nobody_listens_to_anymore_closes_it_without_error():
    """The thread may end on its own tick once stop is asked, before stop wakes it, and its
    end of the waking pipe is gone: waking nobody (zmq.Again) is not an error, and stop still
    closes the sockets."""
    import zmq

    from pdserve.transfer.io_thread import IOThread

    context = zmq.Context()
    io = IOThread("test-io", context)
    io.start(on_socket=lambda socket: None, on_tick=lambda: None, tick_s=0.01)
    io._stop.set()
    io._thread.join(5)
    assert not io._thread.is_alive()
    io._wake_tx.close(0)
    io._wake_tx = context.socket(zmq.PUSH)  # NOTE: no peer: a send that cannot block fails
    with pytest.raises(zmq.Again):
        io._wake_tx.send(b"", zmq.NOBLOCK)
    io.stop()
    assert io._wake_tx.closed and io._wake_rx.closed
    context.term()  # NOTE: hangs if a socket were left open


def test_prefill_names_a_token_mismatch_when_decode_goes_silent_after_its_hello(caplog):
    """A decode worker with another token refuses prefill's proof and says nothing more: the
    prefill worker's log says so, not only that an unregistered peer fell silent."""
    server_config = dataclasses.replace(CONFIG, auth_token=TOKEN, peer_timeout_s=0.5)
    server = PrefillTransferServer(server_config, layout(CASE), metadata_spec(CASE), "p")
    server.start()
    client_config = dataclasses.replace(CONFIG, auth_token="another-token")
    page_bytes = KVStager(pools(CASE, 30, seed=None)).page_bytes
    client = DecodeTransferClient(client_config, layout(CASE), metadata_spec(CASE), "d", page_bytes)
    client.start()
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.transfer.endpoint"):
            receiver = client.receiver(9, "127.0.0.1", server.port, [1, 2])
            wait_until(lambda: finished(receiver), "decode's room to fail", 10)
            assert "authentication failed" in receiver.failure.message
            wait_until(lambda: "dropped decode peer" in caplog.text, "prefill to drop it", 10)
        assert "another --transfer-token" in caplog.text, caplog.text
    finally:
        client.stop()
        server.stop()
