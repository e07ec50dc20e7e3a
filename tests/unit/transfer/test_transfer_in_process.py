"""Protocol edge cases with both sides in one process, on real sockets over loopback: late and
duplicate messages for finished rooms, reused room ids, prefill-side aborts."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pdserve.engine.runtime.kv_pool import KVPool
from pdserve.protocol.failures import Failure, FailureKind, FailureStage
from pdserve.protocol.transfer_messages import KVChunk, KVPiece, RoomDone, TransferRequest
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.decode_side import DecodeTransferClient
from pdserve.transfer.kv_piece import OutgoingPiece, PageSpan
from pdserve.transfer.kv_staging import KVStager
from pdserve.transfer.prefill_side import PrefillTransferServer
from pdserve.transfer.room_state import TransferState
from tests.e2e.transfer_peers import Case, layout, metadata_spec, pools, record
from tests.waiting import wait_until

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


CONFIG = TransferConfig(
    bootstrap_port=0, progress_timeout_s=10, peer_timeout_s=2, heartbeat_interval_s=0.2
)
CASE = Case(room=1)


@dataclass
class Pair:
    server: PrefillTransferServer
    client: DecodeTransferClient
    target: list[KVPool]
    stager: KVStager

    def transfer(self, case: Case):
        sender = self.server.sender(case.room)
        receiver = self.client.receiver(
            case.room, "127.0.0.1", self.server.port, list(case.decode_pages)
        )
        wait_until(lambda: sender.poll() is TransferState.WAITING_FOR_INPUT, "the request", 10)
        kv = KVStager(pools(case, 20, seed=case.room)).gather([list(case.prefill_pages)])
        sender.send(kv, record(case))
        wait_until(lambda: receiver.poll() is TransferState.SUCCESS, "the transfer", 10)
        wait_until(lambda: sender.poll() is TransferState.SUCCESS, "the ack", 10)
        return sender, receiver


def start_pair(config: TransferConfig) -> Pair:
    server = PrefillTransferServer(config, layout(CASE), metadata_spec(CASE), "p")
    server.start()
    target = pools(CASE, 30, seed=None)
    stager = KVStager(target)
    client = DecodeTransferClient(config, layout(CASE), metadata_spec(CASE), "d", stager.page_bytes)
    client.start()
    return Pair(server, client, target, stager)


@pytest.fixture
def pair():
    started = start_pair(CONFIG)
    yield started
    started.client.stop()
    started.server.stop()


def test_late_messages_for_a_finished_room_are_ignored(pair):
    server, client = pair.server, pair.client
    sender, receiver = pair.transfer(CASE)
    receiver.commit(pair.stager)
    committed = pair.target[0].storage.clone()
    server.release(CASE.room)
    client.release(CASE.room)
    # Replay the finished room's messages from prefill, and its request from decode.
    decode_peer = sender.peer
    piece = KVPiece(CASE.room, 0, 0, 1, 0, 0, 16)
    server.io.call(lambda: server.send(decode_peer, piece))
    server.io.call(lambda: server.send(decode_peer, KVChunk(CASE.room, 0, 0, 16), b"\xff" * 16))
    server.io.call(lambda: server.send(decode_peer, RoomDone(CASE.room, 16, 1)))
    peer = next(iter(client.peers.values()))
    client.io.call(lambda: client.send(peer, TransferRequest(CASE.room, 1, 0)))
    # A new room still works, and nothing of the replay landed anywhere. NOTE: each side
    # sends on one socket in order, so room 2 finishing means the replay was handled.
    _, receiver2 = pair.transfer(Case(room=2))
    assert receiver.poll() is TransferState.SUCCESS
    assert sender.poll() is TransferState.SUCCESS
    assert receiver2.poll() is TransferState.SUCCESS
    assert torch.equal(pair.target[0].storage, committed)
    # The replayed request did not bring the released room back to life.
    revived = server.sender(CASE.room)
    assert revived.poll() is TransferState.FAILED
    assert "reused" in revived.failure.message


def test_each_side_rings_its_doorbell_when_a_room_moves(pair):
    """A worker's engine loop sleeps in its socket poll while its rooms are in flight; the
    endpoint's doorbell wakes it for each change it acts on (decode's KV landed, prefill's
    room acked, a failure)."""
    import select

    def rung(bell) -> bool:
        return bool(select.select([bell], [], [], 0)[0])

    bells = [pair.server.doorbell, pair.client.doorbell]
    for bell in bells:
        bell.answer()
    assert not any(rung(bell) for bell in bells)
    pair.transfer(CASE)
    assert all(rung(bell) for bell in bells)
    for bell in bells:
        bell.answer()
    pair.server.sender(9).abort(FailureKind.ABORTED, "client gone")  # failed on the IO thread
    wait_until(lambda: rung(pair.server.doorbell), "the failure's ring", 5)


def test_reusing_a_finished_room_id_is_refused_on_decode(pair):
    pair.transfer(CASE)
    pair.client.release(CASE.room)
    with pytest.raises(ValueError, match="already in use"):
        pair.client.receiver(CASE.room, "127.0.0.1", pair.server.port, [1, 2, 3])


def test_prefill_abort_reaches_decode_at_once(pair):
    sender = pair.server.sender(CASE.room)
    receiver = pair.client.receiver(CASE.room, "127.0.0.1", pair.server.port, [1, 2, 3])
    wait_until(lambda: sender.poll() is TransferState.WAITING_FOR_INPUT, "the request", 10)
    sender.abort(FailureKind.INVALID, "prompt of 9000 tokens exceeds the context length")
    wait_until(lambda: receiver.poll() is TransferState.FAILED, "decode to learn of it", 2)
    assert receiver.failure == Failure(
        FailureKind.INVALID,
        FailureStage.BOOTSTRAP,
        "prefill: prompt of 9000 tokens exceeds the context length",
    )
    assert sender.poll() is TransferState.FAILED


def assert_the_next_room_lands_in_its_pages(pair: Pair, room: int) -> None:
    """After a disturbed room, the next one's bytes land in its own pages: the link's order
    held."""
    later = Case(room=room, prefill_pages=(19, 0, 4))
    _, receiver = pair.transfer(later)
    receiver.commit(pair.stager)
    source = pools(later, 20, seed=later.room)[0]
    target = pair.target[0].storage
    assert torch.equal(source.storage[:, :, [19, 0, 4]], target[:, :, [0, 7, 3]])


def test_gloo_receive_posted_for_an_aborted_room_keeps_the_pair_in_order():
    """Decode aborts a room after prefill announced its bytes: decode still posts a receive
    (into scratch) so prefill's announced buffer is sent and released, and the next room's
    bytes land where they belong."""
    import dataclasses
    import threading

    pair = start_pair(dataclasses.replace(CONFIG, backend="gloo"))
    server, client = pair.server, pair.client
    try:
        pair.transfer(Case(room=10))  # the link is up
        sender = server.sender(11)
        receiver = client.receiver(11, "127.0.0.1", server.port, [1, 2, 3])
        wait_until(lambda: sender.poll() is TransferState.WAITING_FOR_INPUT, "the request", 10)
        held = threading.Event()
        client.io.call(lambda: held.wait(10))  # stall decode's IO thread
        kv = KVStager(pools(Case(room=11), 20, seed=11)).gather([[5, 2, 9]])
        sender.send(kv, record(Case(room=11)))  # the announcement waits in decode's socket
        receiver.abort(FailureKind.ABORTED, "client went away")
        held.set()
        wait_until(lambda: sender.poll() is TransferState.FAILED, "prefill to learn of it", 10)
        wait_until(lambda: server.pending_sends == 0, "the announced buffer to be sent", 10)
        assert_the_next_room_lands_in_its_pages(pair, room=12)
    finally:
        client.stop()
        server.stop()


def test_a_piece_other_ranks_sent_is_announced_even_after_its_room_failed():
    """With per-rank-pair links the other ranks post their parts of a piece before rank 0's
    IO thread sees it: if the room failed meanwhile, the piece must still be announced (and
    rank 0's parts sent), so that decode posts every link's receives (into scratch) and the
    next room's bytes land where they belong."""
    import dataclasses

    pair = start_pair(dataclasses.replace(CONFIG, backend="gloo"))
    server, client = pair.server, pair.client
    try:
        pair.transfer(Case(room=20))  # the link is up
        sent_before = server.metrics.bytes_sent
        sender = server.sender(21)
        client.receiver(21, "127.0.0.1", server.port, [1, 2, 3])
        wait_until(lambda: sender.poll() is TransferState.WAITING_FOR_INPUT, "the request", 10)
        kv = KVStager(pools(Case(room=21), 20, seed=21)).gather([[5, 2, 9]])
        # As `PerRankKV.gather_piece` makes it when another rank sent a part already.
        piece = OutgoingPiece(PageSpan(0, 3), sends=[(0, kv)], remote=1, nbytes=kv.numel())
        sender.abort(FailureKind.INTERNAL, "prefill failed")  # runs first on the IO thread
        sender.send_piece(piece)
        wait_until(lambda: sender.poll() is TransferState.FAILED, "the failure", 10)
        wait_until(lambda: server.metrics.bytes_sent == sent_before + kv.numel(), "the send", 10)
        assert_the_next_room_lands_in_its_pages(pair, room=22)
    finally:
        client.stop()
        server.stop()
