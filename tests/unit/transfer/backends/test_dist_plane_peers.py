"""What the torch.distributed planes know of each peer lives in their own table, not on `Peer`:
the TP size from the handshake, the links made to it, and nothing left once it is forgotten.
The planes are driven directly, with a stand-in endpoint, links and rank fan-out (no sockets,
no rendezvous)."""

from __future__ import annotations

import types

import pytest
import torch
import zmq

from pdserve.protocol.rank_messages import (
    RankDropSlices,
    RankLinkConnect,
    RankLinkForget,
    RankTransferReport,
)
from pdserve.protocol.transfer_messages import HelloReply, Register
from pdserve.transfer.backends.dist.dist_plane import DistSendPlane
from pdserve.transfer.backends.dist.dist_receive_plane import DistReceivePlane
from pdserve.transfer.backends.dist.head_slices import head_slices
from pdserve.transfer.kv_piece import OutgoingPiece, PageSpan
from pdserve.transfer.peer import Peer

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


KV_HEADS = 4


class FakeLinks:
    """Records what the plane asks of rank 0's links."""

    backend = "gloo"
    stream = None

    def __init__(self):
        self.connected: list[tuple] = []
        self.forgotten: list[tuple] = []

    def connect(self, peer_key, store_address, pair_name, done) -> None:
        self.connected.append(peer_key)

    def forget(self, peer_key) -> None:
        self.forgotten.append(peer_key)

    def send(self, peer_key, data, ready, done) -> None:
        pass  # never ends: the send stays pending

    def serve_store(self, host: str) -> str:
        return "127.0.0.1:1"


class FakeFanout:
    """The other ranks of a worker at TP `tp_size`: records what rank 0 tells them, and hands
    out queued reports."""

    def __init__(self, tp_size: int):
        self.tp_size = tp_size
        self.posted: list[tuple[int, object]] = []
        self.queued: list[RankTransferReport] = []
        self.reports = types.SimpleNamespace(receive=self._receive)

    def post(self, rank: int, msg) -> None:
        self.posted.append((rank, msg))

    def _receive(self, flags):
        if not self.queued:
            raise zmq.Again()
        return types.SimpleNamespace(msg=self.queued.pop(0))


class FakeEndpoint:
    def __init__(self, side: str):
        self.side = side
        self.config = types.SimpleNamespace(
            backend="gloo", progress_timeout_s=5.0, bootstrap_host="127.0.0.1"
        )
        self.layout = types.SimpleNamespace(num_kv_heads=KV_HEADS)
        self.page_bytes = [KV_HEADS * 64]
        self.worker_id = "decode-0"
        self.peers: dict = {}
        self.dropped: list[tuple[Peer, str]] = []

    def drop_peer(self, peer, kind, reason) -> None:
        self.dropped.append((peer, reason))

    def send(self, peer, msg, *payload) -> bool:
        return True


def send_plane(tp_size: int = 1) -> tuple[DistSendPlane, FakeFanout | None]:
    fanout = FakeFanout(tp_size) if tp_size > 1 else None
    plane = DistSendPlane(FakeEndpoint("prefill"), torch.device("cpu"), fanout)
    plane.links = FakeLinks()
    return plane, fanout


def receive_plane(tp_size: int = 1) -> tuple[DistReceivePlane, FakeFanout | None]:
    fanout = FakeFanout(tp_size) if tp_size > 1 else None
    plane = DistReceivePlane(FakeEndpoint("decode"), torch.device("cpu"), fanout)
    plane.links = FakeLinks()
    return plane, fanout


def decode_peer(key: str = "decode-key") -> Peer:
    return Peer(key, outbox=None)


def register(tp_size: int) -> Register:
    return Register(
        "decode-0", None, store_address="127.0.0.1:1", pair_name="pair/p", tp_size=tp_size
    )


def hello(tp_size: int) -> HelloReply:
    return HelloReply("prefill-0", 1, b"n", b"p", tp_size=tp_size)


def test_prefill_records_the_tp_size_decode_registered_with():
    plane, _ = send_plane()
    peer = decode_peer()
    plane.registered(peer, register(tp_size=2))
    assert plane.tp_size_of(peer) == 2
    assert plane.links_of(peer).slices == tuple(head_slices(KV_HEADS, 1, 2))
    assert plane.links.connected == [(peer.key, 0), (peer.key, 1)]


def test_decode_records_the_tp_size_prefill_answered_with():
    plane, _ = receive_plane()
    peer = decode_peer("tcp://127.0.0.1:5000")
    assert plane.hello_problem(peer, hello(tp_size=2)) is None
    assert plane.tp_size_of(peer) == 2
    registration = plane.registration(peer, register(tp_size=1))
    assert registration.tp_size == 1 and registration.store_address == "127.0.0.1:1"
    assert plane.links_of(peer).slices == tuple(head_slices(KV_HEADS, 2, 1))


def test_a_tp_size_that_does_not_split_the_heads_is_refused_and_not_recorded():
    plane, _ = receive_plane()
    peer = decode_peer("tcp://127.0.0.1:5000")
    assert "prefill's tensor-parallel size" in plane.hello_problem(peer, hello(tp_size=3))
    assert plane.tp_size_of(peer) is None


def test_an_unknown_peer_has_no_links_and_no_tp_size():
    plane, _ = send_plane()
    peer = decode_peer()
    assert plane.links_of(peer) is None and plane.tp_size_of(peer) is None
    plane.forget(peer)  # nothing to forget
    assert plane.links.forgotten == []


def test_a_forgotten_peer_leaves_no_state_and_no_link_id():
    plane, fanout = send_plane(tp_size=2)
    peer = decode_peer()
    plane.endpoint.peers[peer.key] = peer  # NOTE: kept, so only the plane's table decides
    plane.registered(peer, register(tp_size=2))
    link = plane.links_of(peer).id
    assert (1, RankLinkConnect(link, 1, "127.0.0.1:1", "pair/p/1-1")) in fanout.posted
    plane.forget(peer)
    assert plane.links_of(peer) is None and plane.tp_size_of(peer) is None
    assert plane.links.forgotten == [(peer.key, 0)]
    assert fanout.posted[-1] == (1, RankLinkForget(link))
    # A rank's report about the forgotten link finds no peer: nobody is dropped for it.
    fanout.queued.append(RankTransferReport("link", 1, link, 1, 0, 0, 0, "broken"))
    plane.on_reports()
    assert plane.endpoint.dropped == []


def test_a_report_about_a_live_link_reaches_its_peer():
    """(The counterpart of the test above: the report is acted on while the peer is known.)"""
    plane, fanout = send_plane(tp_size=2)
    peer = decode_peer()
    plane.endpoint.peers[peer.key] = peer
    plane.registered(peer, register(tp_size=2))
    fanout.queued.append(RankTransferReport("link", 1, plane.links_of(peer).id, 1, 0, 0, 0, "x"))
    plane.on_reports()
    assert [dropped for dropped, _ in plane.endpoint.dropped] == [peer]


def test_a_new_peer_under_an_old_key_starts_with_no_links():
    plane, _ = send_plane()
    old, new = decode_peer(), decode_peer()
    plane.registered(old, register(tp_size=2))
    old_link = plane.links_of(old).id
    assert plane.links_of(new) is None and plane.tp_size_of(new) is None
    plane.forget(new)  # not the peer the state is for: the old one keeps it
    assert plane.links_of(old) is not None
    plane.registered(new, register(tp_size=1))
    assert plane.links_of(old) is None  # the old peer's links went when the new one came
    assert sorted(plane.links.forgotten) == [(old.key, 0), (old.key, 1)]
    assert plane.tp_size_of(new) == 1 and plane.links_of(new).id != old_link


def test_prefill_forgets_a_peers_pending_sends_with_it():
    plane, _ = send_plane()
    peer = decode_peer()
    plane.registered(peer, register(tp_size=1))
    room = types.SimpleNamespace(room=3, peer=peer)
    data = torch.zeros(64, dtype=torch.uint8)
    assert plane.send_piece(room, OutgoingPiece(PageSpan(0, 1), data), 0)
    assert plane.pending_sends == 1
    plane.forget(peer)
    assert plane.pending_sends == 0


def test_a_failed_room_on_tp2_decode_has_rank_1_drop_its_parts_after_its_peer_went():
    plane, fanout = receive_plane(tp_size=2)
    peer = decode_peer("tcp://127.0.0.1:5000")
    plane.hello_problem(peer, hello(tp_size=1))
    plane.registration(peer, register(tp_size=2))
    plane.forget(peer)
    room = types.SimpleNamespace(
        room=7, expected_bytes=64, has_remote_parts=True, failure="aborted", peer=peer
    )
    plane.room_ended(room)
    assert fanout.posted[-1] == (1, RankDropSlices(7))


def test_a_room_that_succeeded_leaves_the_ranks_parts_alone():
    plane, fanout = receive_plane(tp_size=2)
    room = types.SimpleNamespace(
        room=8, expected_bytes=64, has_remote_parts=True, failure=None, peer=None
    )
    plane.room_ended(room)
    assert not any(isinstance(msg, RankDropSlices) for _, msg in fanout.posted)
