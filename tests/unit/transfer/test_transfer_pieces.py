"""A room's KV in pieces (transfer/kv_piece): the receiving side's checks before it allocates,
pieces of several rooms arriving out of order and interleaved on the tcp, gloo and memory
data planes, and a prefill that fails after sending some of a room's pieces."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.protocol.failures import FailureKind
from pdserve.transfer.decode_side import DecodeTransferClient
from pdserve.transfer.kv_piece import OutgoingPiece, PageSpan, PieceLedger
from pdserve.transfer.kv_staging import KVStager
from pdserve.transfer.prefill_side import PrefillTransferServer
from pdserve.transfer.room_state import TransferState
from tests.e2e.transfer_peers import Case, layout, metadata_spec, pools, record
from tests.unit.transfer.test_transfer_in_process import CONFIG, Pair
from tests.waiting import wait_until

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


PAGE_BYTES = [100, 10]  # target pool, draft pool


def test_a_piece_is_checked_against_the_reservation_before_anything_is_allocated():
    ledger = PieceLedger(num_pages=4, num_draft_pages=4, page_bytes=PAGE_BYTES)
    assert ledger.expected_bytes == 440
    assert "covers pages [3, 5)" in ledger.check(0, PageSpan(3, 2), 200).message
    assert "covers pages [-1, 0)" in ledger.check(0, PageSpan(-1, 1), 100).message
    assert "covers pages [0, 5)" in ledger.check(0, PageSpan(0, 0, 0, 5), 50).message
    assert "covers no page" in ledger.check(0, PageSpan(1, 0), 0).message
    assert "announced 150 bytes" in ledger.check(0, PageSpan(0, 1, 0, 1), 150).message
    assert ledger.check(0, PageSpan(0, 2), 200) is None
    ledger.add(0, PageSpan(0, 2), torch.empty(200, dtype=torch.uint8))
    assert "announced twice" in ledger.check(0, PageSpan(2, 1), 100).message
    assert "already covered" in ledger.check(1, PageSpan(1, 2), 200).message
    assert ledger.check(1, PageSpan(2, 2, 0, 4), 240) is None


def test_a_room_is_complete_only_when_every_page_is_covered_and_every_byte_landed():
    ledger = PieceLedger(num_pages=2, num_draft_pages=0, page_bytes=PAGE_BYTES[:1])
    ledger.add(1, PageSpan(1, 1), torch.empty(100, dtype=torch.uint8))
    chunk = ledger.chunk_target(1, 0, 60)
    assert chunk.numel() == 60 and "expected offset 0" in ledger.chunk_target(1, 10, 10).message
    ledger.landed(1, 60)
    assert "expected offset 60 of 100" in ledger.chunk_target(1, 60, 50).message
    ledger.landed(1, 40)
    assert not ledger.complete  # page 0 never announced
    ledger.add(0, PageSpan(0, 1), torch.empty(100, dtype=torch.uint8), in_flight=True)
    assert len(ledger.buffers()) == 1  # the one a receive may still write stays
    ledger.landed(0, 100)
    assert ledger.complete and len(ledger.buffers()) == 1


def test_pages_the_receiver_holds_already_are_neither_expected_nor_accepted():
    ledger = PieceLedger(num_pages=4, num_draft_pages=0, page_bytes=PAGE_BYTES[:1], num_cached=2)
    assert ledger.expected_bytes == 200
    assert (
        "the first 2 pages are the receiver's own" in ledger.check(0, PageSpan(1, 2), 200).message
    )
    assert ledger.check(0, PageSpan(2, 1), 100) is None
    ledger.add(0, PageSpan(2, 1), torch.empty(100, dtype=torch.uint8))
    ledger.landed(0, 100)
    assert not ledger.complete  # page 3 missing
    ledger.add(1, PageSpan(3, 1), torch.empty(100, dtype=torch.uint8))
    ledger.landed(1, 100)
    assert ledger.complete
    with pytest.raises(ValueError, match="4 cached pages of a room with 4"):
        PieceLedger(num_pages=4, num_draft_pages=0, page_bytes=PAGE_BYTES[:1], num_cached=4)


DRAFT = Case(room=0, draft=True)  # both sides hold a target and a draft KV pool


@pytest.fixture(params=["tcp", "gloo", "memory"])
def backend_pair(request):
    config = dataclasses.replace(CONFIG, backend=request.param)
    server = PrefillTransferServer(config, layout(DRAFT), metadata_spec(DRAFT), "p")
    server.start()
    target = pools(DRAFT, 30, seed=None)
    stager = KVStager(target)
    client = DecodeTransferClient(
        config, layout(DRAFT), metadata_spec(DRAFT), "d", stager.page_bytes
    )
    client.start()
    pair = Pair(server, client, target, stager)
    yield pair
    client.stop()
    server.stop()


def pieces(case: Case, spans: list[PageSpan], seed: int) -> list[OutgoingPiece]:
    """The spans of `case`'s prefill pages, each gathered from a seeded source pool."""
    stager = KVStager(pools(case, 20, seed=seed))
    pages = list(case.prefill_pages)
    return [OutgoingPiece(span, stager.gather(span.page_lists(pages, pages, 2))) for span in spans]


def send_whole(pair: Pair, case: Case) -> None:
    """A room sent as one piece, drafts included, arrives (the pair is in order)."""
    sender = pair.server.sender(case.room)
    pages = list(case.decode_pages)
    receiver = pair.client.receiver(case.room, "127.0.0.1", pair.server.port, pages, pages)
    wait_until(lambda: sender.poll() is TransferState.WAITING_FOR_INPUT, "the request", 20)
    n = len(pages)
    sender.send_piece(pieces(case, [PageSpan(0, n, 0, n)], seed=case.room)[0])
    sender.finish(record(case))
    wait_until(lambda: receiver.poll() is TransferState.SUCCESS, "the room", 20)


def test_pieces_out_of_order_and_interleaved_with_another_room_commit_exactly(backend_pair):
    server, client = backend_pair.server, backend_pair.client
    a = Case(room=50, draft=True, prefill_pages=(5, 2, 9, 11), decode_pages=(0, 7, 3, 12))
    b = Case(room=51, draft=True, prefill_pages=(1, 4, 6, 8), decode_pages=(13, 1, 9, 2))
    rooms = {}
    for case in (a, b):
        sender = server.sender(case.room)
        pages = list(case.decode_pages)
        receiver = client.receiver(case.room, "127.0.0.1", server.port, pages, pages)
        rooms[case.room] = (sender, receiver)
    for sender, _ in rooms.values():
        wait_until(lambda s=sender: s.poll() is TransferState.WAITING_FOR_INPUT, "requests", 20)
    # Room a: the end first, then the start (draft KV in the middle piece); room b in between.
    a_pieces = pieces(a, [PageSpan(2, 2), PageSpan(0, 1, 0, 4), PageSpan(1, 1)], seed=a.room)
    b_pieces = pieces(b, [PageSpan(0, 3), PageSpan(3, 1, 0, 4)], seed=b.room)
    sender_a, sender_b = rooms[a.room][0], rooms[b.room][0]
    sender_a.send_piece(a_pieces[0])
    sender_b.send_piece(b_pieces[0])
    sender_a.send_piece(a_pieces[1])
    sender_b.send_piece(b_pieces[1])
    sender_b.finish(record(b))
    sender_a.send_piece(a_pieces[2])
    sender_a.finish(record(a))
    for case in (a, b):
        sender, receiver = rooms[case.room]
        wait_until(lambda r=receiver: r.poll() is TransferState.SUCCESS, "the room", 20)
        wait_until(lambda s=sender: s.poll() is TransferState.SUCCESS, "the ack", 20)
    decode = backend_pair.stager
    for case in (a, b):
        rooms[case.room][1].commit(decode)
        source = pools(case, 20, seed=case.room)
        for pool, source_pool in zip(decode.pools, source, strict=True):
            got = pool.storage[:, :, list(case.decode_pages)]
            assert torch.equal(got, source_pool.storage[:, :, list(case.prefill_pages)])
    assert server.metrics.pieces_sent == 5


def test_a_prefill_failing_after_some_pieces_fails_the_room_and_writes_no_page(backend_pair):
    server, client, stager = backend_pair.server, backend_pair.client, backend_pair.stager
    case = Case(room=60, draft=True)
    sender = server.sender(case.room)
    receiver = client.receiver(case.room, "127.0.0.1", server.port, list(case.decode_pages))
    wait_until(lambda: sender.poll() is TransferState.WAITING_FOR_INPUT, "the request", 20)
    before = stager.pools[0].storage.clone()
    sender.send_piece(pieces(case, [PageSpan(0, 2)], seed=case.room)[0])
    wait_until(lambda: receiver.poll() is TransferState.TRANSFERRING, "the first piece", 20)
    sender.abort(FailureKind.INTERNAL, "the prefill step failed: CUDA error")
    wait_until(lambda: receiver.poll() is TransferState.FAILED, "decode to learn of it", 5)
    assert receiver.failure.kind is FailureKind.ABORTED
    assert "prefill: the prefill step failed" in receiver.failure.message
    assert torch.equal(stager.pools[0].storage, before)
    wait_until(lambda: client.buffers.cached_bytes > 0, "the piece's buffer to come back", 10)
    wait_until(lambda: server.pending_sends == 0, "prefill's send to complete", 10)
    send_whole(backend_pair, Case(room=61, draft=True))  # the pair stays usable


def test_a_piece_outside_the_reservation_fails_the_room_with_the_reason(backend_pair):
    server, client = backend_pair.server, backend_pair.client
    case = Case(room=70, draft=True)
    sender = server.sender(case.room)
    receiver = client.receiver(case.room, "127.0.0.1", server.port, list(case.decode_pages))
    wait_until(lambda: sender.poll() is TransferState.WAITING_FOR_INPUT, "the request", 20)
    wrong = pieces(Case(room=70, draft=True, prefill_pages=(5, 2, 9, 11)), [PageSpan(2, 2)], 1)[0]
    sender.send_piece(wrong)
    wait_until(lambda: receiver.poll() is TransferState.FAILED, "the check", 10)
    assert "covers pages [2, 4) of a room with 3 reserved" in receiver.failure.message
    wait_until(lambda: sender.poll() is TransferState.FAILED, "prefill to learn of it", 10)
    send_whole(backend_pair, Case(room=71, draft=True))  # the pair stays in order


class NeverReady:
    """A CUDA event of a GPU that hangs: its copy never completes."""

    def query(self) -> bool:
        return False


class Now:
    def query(self) -> bool:
        return True


def test_a_staged_piece_whose_copy_never_completes_runs_expired_in_its_place():
    from pdserve.transfer.staged_sends import StagedSends

    class IO:
        def __init__(self):
            self.ran = []

        def call(self, command):
            self.ran.append(command())

    io = IO()
    staged = StagedSends(io, timeout_s=0.2)
    try:
        staged.submit(lambda: "sent 0", Now(), lambda: "failed 0")
        staged.submit(lambda: "sent 1", NeverReady(), lambda: "failed 1")
        staged.submit(lambda: "finished", None)
        wait_until(lambda: len(io.ran) == 3, "the three steps", 5)
        assert io.ran == ["sent 0", "failed 1", "finished"]
    finally:
        staged.stop()
