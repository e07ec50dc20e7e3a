"""DistLinks' bookkeeping with links that connect when the test says: transfers posted while a
link is being created go out on it, in order, once it exists; a peer dropped while its link
was being created never gets that link, even when it connects again meanwhile."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.transfer.backends.dist import dist_links
from pdserve.transfer.backends.dist.dist_links import DistLinks
from tests.waiting import wait_until


class Landed:
    def wait(self, timeout_s: float) -> None:
        pass


class FakeLink:
    backend = "gloo"
    device = torch.device("cpu")

    def __init__(self, pair_name: str):
        self.pair_name = pair_name
        self.posted: list[tuple[str, int]] = []
        self.closed = False

    def isend(self, tensor):
        self.posted.append(("send", int(tensor[0])))
        return Landed()

    def irecv(self, tensor):
        self.posted.append(("recv", int(tensor[0])))
        return Landed()

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def gated(monkeypatch):
    """Links whose creation waits for the test: gates[pair_name].set() lets one finish."""
    gates: dict[str, threading.Event] = {}
    made: dict[str, FakeLink] = {}

    def connect(*, pair_name, **_):
        gates.setdefault(pair_name, threading.Event()).wait(10)
        made[pair_name] = FakeLink(pair_name)
        return made[pair_name]

    monkeypatch.setattr(dist_links.PairLink, "connect", staticmethod(connect))
    monkeypatch.setattr(dist_links, "client_store", lambda *args: None)
    links = DistLinks("gloo", "prefill", 5.0, torch.device("cpu"), "127.0.0.1")
    yield links, gates, made
    links.close()


def test_posts_wait_for_the_link_and_go_out_in_order(gated):
    links, gates, made = gated
    results: list[str | None] = []
    links.connect("peer", "h:1", "pair/a", lambda error: None)
    for value in (1, 2, 3):
        links.send("peer", torch.tensor([value]), None, results.append)
    gates.setdefault("pair/a", threading.Event()).set()
    wait_until(lambda: len(results) == 3, "the three sends")
    assert made["pair/a"].posted == [("send", 1), ("send", 2), ("send", 3)]
    assert results == [None, None, None]


def test_a_link_created_for_a_dropped_peer_is_closed_not_used(gated):
    links, gates, made = gated
    links.connect("peer", "h:1", "pair/old", lambda error: None)
    links.forget("peer")
    links.connect("peer", "h:1", "pair/new", lambda error: None)  # it came back
    results: list[str | None] = []
    links.send("peer", torch.tensor([7]), None, results.append)
    # The old attempt ends first, while the new one is still connecting: it must not take the
    # peer (nor the send waiting for the new link).
    gates.setdefault("pair/old", threading.Event()).set()
    wait_until(lambda: "pair/old" in made and made["pair/old"].closed, "the old link closed")
    gates.setdefault("pair/new", threading.Event()).set()
    wait_until(lambda: results == [None], "the send on the new link")
    assert made["pair/new"].posted == [("send", 7)] and made["pair/old"].posted == []
    links.send("peer", torch.tensor([8]), None, results.append)
    wait_until(lambda: len(results) == 2, "a later send")
    assert made["pair/new"].posted[-1] == ("send", 8)
