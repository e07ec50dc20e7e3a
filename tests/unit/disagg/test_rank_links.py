"""A tensor-parallel rank's own KV links (`pdserve.disagg.rank_links`) without processes: rank
1 of a TP 2 prefill worker and rank 1 of a TP 2 decode worker, each a `RankLinks` over a CPU
pool, linked over gloo; rank 0's orders are given by hand and the reports read where rank 0
reads them. What lands is written only at a commit, into the pages named; parts dropped or
received into scratch are never written anywhere, and the link stays in order."""

from __future__ import annotations

import types

import pytest
import torch
import zmq

from pdserve.disagg import rank_links as rank_links_module
from pdserve.disagg.rank_links import RankLinkError, RankLinks
from pdserve.engine.runtime.kv_pool import KVPool
from pdserve.protocol.channel import Channel
from pdserve.protocol.rank_messages import (
    RankCommitSlices,
    RankDropSlices,
    RankLinkConnect,
    RankReceiveSlices,
    RankSendSlices,
    RankTransferReport,
    RankTransferStart,
)
from pdserve.transfer.backends.dist.dist_store import DecodeStoreServer

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


HEADS = 4  # the model's; rank 1 of TP 2 holds heads 2 and 3
PAIR = "pair/test/1-1"


def rank_links(seed: int | None) -> RankLinks:
    pool = KVPool(
        num_layers=2,
        num_pages=12,
        page_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    if seed is not None:
        pool.storage.copy_(torch.randn(pool.storage.shape, generator=torch.manual_seed(seed)))
    split = types.SimpleNamespace(num_kv_heads=HEADS)
    worker = types.SimpleNamespace(tp=types.SimpleNamespace(rank=1, size=2, split=split))
    worker.kv_pool = pool
    return RankLinks(worker)


@pytest.fixture
def ranks():
    """(prefill rank, decode rank, next report): linked, both reporting to one socket."""
    context = zmq.Context()
    reports = Channel(context, zmq.PULL, accepts=(RankTransferReport,))
    address = f"tcp://127.0.0.1:{reports.bind_random_port('tcp://127.0.0.1')}"
    store = DecodeStoreServer("127.0.0.1", 0, 10.0)
    prefill, decode = rank_links(seed=1), rank_links(seed=None)
    for side, links, link in (("prefill", prefill, 7), ("decode", decode, 9)):
        links.handle(RankTransferStart(side, "gloo", 10.0, "127.0.0.1", address))
        links.handle(RankLinkConnect(link, 1, f"127.0.0.1:{store.port}", PAIR))

    def report() -> RankTransferReport:
        assert reports.socket.poll(10_000), "no report within 10 s"
        return reports.receive().msg

    yield prefill, decode, report
    for links in (prefill, decode):
        links.close()
    store.close()
    reports.close()
    context.term()


def piece_bytes(pages: int) -> int:
    return 2 * 2 * pages * 4 * 2 * 8 * 4  # K and V, layers, pages, slots, heads, dims, fp32


def send(prefill: RankLinks, pages: list[int]) -> None:
    prefill.handle(RankSendSlices(7, pages, [1], [2], [2]))


def receive(decode: RankLinks, room: int, pages: int, scratch: bool = False) -> None:
    decode.handle(RankReceiveSlices(room, 0, scratch, 9, [1], [piece_bytes(pages)], [2], [2]))


def test_a_part_lands_and_is_written_only_at_its_commit(ranks):
    prefill, decode, report = ranks
    receive(decode, room=5, pages=2)
    send(prefill, [3, 1])
    got = {report().kind: None for _ in range(2)}
    assert set(got) == {"sent", "landed"}
    assert not decode.pool.storage.any(), "nothing is written before the commit"
    decode.handle(RankCommitSlices(5, [0], [6, 8], [2], 1))
    source, target = prefill.pool.storage, decode.pool.storage
    assert torch.equal(target[:, :, [6, 8]], source[:, :, [3, 1]])
    target[:, :, [6, 8]] = 0
    assert not target.any(), "no other page was written"


def test_dropped_and_scratch_parts_are_never_written_and_the_link_stays_in_order(ranks):
    prefill, decode, report = ranks
    receive(decode, room=1, pages=1)
    decode.handle(RankDropSlices(1))  # before it lands
    receive(decode, room=2, pages=3, scratch=True)
    receive(decode, room=3, pages=1)
    for pages in ([0], [4, 5, 6], [2]):
        send(prefill, pages)
    kinds = sorted(report().kind for _ in range(4))  # three sends; room 3 alone lands
    assert kinds == ["landed", "sent", "sent", "sent"]
    with pytest.raises(RankLinkError, match="0 parts here"):
        decode.handle(RankCommitSlices(1, [0], [9], [1], 1))
    decode.handle(RankCommitSlices(3, [0], [10], [1], 1))
    assert torch.equal(decode.pool.storage[:, :, 10], prefill.pool.storage[:, :, 2])
    decode.pool.storage[:, :, 10] = 0
    assert not decode.pool.storage.any()


def test_a_commit_before_its_part_landed_is_refused(ranks):
    prefill, decode, report = ranks
    receive(decode, room=4, pages=1)
    with pytest.raises(RankLinkError, match="before piece 0 landed"):
        decode.handle(RankCommitSlices(4, [0], [3], [1], 1))
    send(prefill, [0])  # what lands now is given back, not written
    assert report().kind == "sent"
    assert not decode.pool.storage.any()


def test_a_landed_part_no_commit_claims_is_dropped_after_its_deadlines(ranks, monkeypatch):
    """A room that succeeded and then ended without its commit (aborted in between) leaves
    its parts on the ranks: they go once they are older than `UNCLAIMED_DEADLINES` link
    deadlines (none here), at the rank's next order."""
    prefill, decode, report = ranks
    monkeypatch.setattr(rank_links_module, "UNCLAIMED_DEADLINES", 0)
    receive(decode, room=6, pages=1)
    send(prefill, [0])
    assert sorted(report().kind for _ in range(2)) == ["landed", "sent"]
    decode.handle(RankDropSlices(99))  # any order: another room's
    with pytest.raises(RankLinkError, match="0 parts here"):
        decode.handle(RankCommitSlices(6, [0], [3], [1], 1))
    assert not decode.pool.storage.any()
