"""The prefill side's decode peers: the handshake, registration and a bound on their number.

A connection's entry is created by `Hello` only: at most `max_peers` of them, and at most
`max_peers_per_host` from one address. At a limit, the oldest connection that has not
registered makes way, else the registered peer idle longest (one serving none of this worker's
rooms: it registers again when it next needs us, see decode_peers); when every one serves
rooms, the connection is refused with `RegisterRejected`, which the decode worker reports
naming this prefill worker and the limit. `Register` must carry decode's proof over both
nonces (see peer_auth); a wrong proof drops the entry, a layout mismatch keeps it marked
rejected for a while so the rooms it asks for fail with the reason rather than a timeout.
Until a connection registered, anything else it sends is answered `NotRegistered` and queues
nothing.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import zmq

from pdserve.protocol.failures import FailureKind
from pdserve.protocol.transfer_messages import (
    Hello,
    HelloReply,
    NotRegistered,
    Register,
    RegisterAck,
    RegisterRejected,
    TransferRequest,
)
from pdserve.transfer import peer_auth
from pdserve.transfer.handshake import layout_mismatches
from pdserve.transfer.outbox import Outbox
from pdserve.transfer.peer import Peer
from pdserve.transfer.room_state import room_failure

logger = logging.getLogger(__name__)


@dataclass
class DecodePeer(Peer):
    decode_nonce: bytes = b""
    prefill_nonce: bytes = b""
    rejected: str | None = None  # proved the token, but its layout does not fit ours
    host: str = ""  # the address it connects from
    # Rooms it asked for whose prefill request has not arrived (under the server's lock).
    waiting_rooms: set[int] = field(default_factory=set)


class DecodePeers:
    """Mixin of PrefillTransferServer (an Endpoint): the handshake; runs on the IO thread."""

    def _on_message(self, identity: bytes, msg, host: str = "") -> None:
        peer = self.peers.get(identity)
        if isinstance(msg, Hello):
            self._hello(identity, msg, host)
        elif peer is None:
            self._not_registered(identity, getattr(msg, "room", -1))
        elif isinstance(msg, Register):
            peer.last_seen = time.monotonic()
            self._register(peer, msg)
        elif peer.rejected is not None and isinstance(msg, TransferRequest):
            message = f"handshake failed: {peer.rejected}"
            self.refuse_room(peer, msg.room, room_failure(message, FailureKind.HANDSHAKE))
        elif not peer.registered:
            self._not_registered(identity, getattr(msg, "room", -1))
        else:
            peer.last_seen = time.monotonic()
            self._handle(peer, msg)

    def _reply(self, identity: bytes, msg) -> None:
        """Answer a connection; one that has not registered gets no queue (a best-effort send)."""
        peer = self.peers.get(identity)
        if peer is not None and peer.registered:
            self.send(peer, msg)
            return
        with contextlib.suppress(zmq.ZMQError):  # it left, or cannot take it: best effort
            self.channel.send(msg, to=identity, flags=zmq.NOBLOCK)

    def _not_registered(self, identity: bytes, room: int) -> None:
        self._reply(identity, NotRegistered(self.instance, room))

    def _hello(self, identity: bytes, msg: Hello, host: str) -> None:
        try:
            peer_auth.check_nonce(msg.nonce)
        except peer_auth.NonceError as e:
            self.malformed(None, str(e))
            return
        old = self.peers.get(identity)
        if old is not None and old.registered:
            # NOTE: decode greets again only when we did not know it (NotRegistered): this
            # one starts over, and what it asked for under its registration is lost.
            reason = "greeted again after it registered: its rooms are lost"
            self.drop_peer(old, FailureKind.PEER_LOST, reason)
        if identity not in self.peers:
            refusal = self._make_room_for_a_peer(host)
            if refusal is not None:
                self.bad_messages.warning("refused a decode connection from %s: %s", host, refusal)
                reason = f"prefill {self.prefill_id} refused the connection: {refusal}"
                self._reply(identity, RegisterRejected(reason))
                return
        # NOTE: an entry left here had not registered: it holds no rooms.
        nonce = peer_auth.new_nonce()
        outbox = Outbox(self.config.peer_timeout_s)
        peer = DecodePeer(identity, outbox, decode_nonce=msg.nonce, prefill_nonce=nonce, host=host)
        self.peers[identity] = peer
        proof = peer_auth.prefill_proof(self.config.auth_token, msg.nonce, nonce)
        reply = self.plane.hello_reply(
            HelloReply(self.prefill_id, self.instance, nonce, proof, tp_size=self.tp_size)
        )
        self._reply(identity, reply)

    def _make_room_for_a_peer(self, host: str) -> str | None:
        """At the limit per host, then in all, close one peer to make way (see the module's
        docstring); why the new connection is refused, if none can go."""
        limit = self.config.max_peers_per_host
        same_host = [p for p in self.peers.values() if p.host == host]
        if len(same_host) >= limit and not self._make_way(same_host):
            return f"{len(same_host)} decode peers from {host} serve rooms (limit {limit} a host)"
        if len(self.peers) >= self.config.max_peers and not self._make_way(self.peers.values()):
            return f"its peer table is full ({len(self.peers)} decode peers, all serving rooms)"
        return None

    def _make_way(self, peers) -> bool:
        """Close the oldest of `peers` that has not registered, else the one idle longest;
        False if every one serves rooms."""
        peers = list(peers)
        pending = [p for p in peers if not p.registered]
        if pending:
            del self.peers[min(pending, key=lambda p: p.last_seen).key]  # NOTE: holds nothing
            return True
        idle = [p for p in peers if not any(room.claimed for room in self.live_rooms(p))]
        if not idle:
            return False
        self.drop_peer(min(idle, key=lambda p: p.last_busy), FailureKind.PEER_LOST, None)
        return True

    def silence(self, peer: DecodePeer, silent_s: float) -> str:
        if peer.registered or not peer.prefill_nonce:
            return super().silence(peer, silent_s)
        # NOTE: a decode worker checks our proof before it registers, and one holding another
        # transfer token refuses it without a word: from here, only its silence shows.
        return (
            f"silent {silent_s:.1f} s after our HelloReply without registering (a decode worker "
            "given another --transfer-token refuses this prefill worker's proof)"
        )

    def _register(self, peer: DecodePeer, msg: Register) -> None:
        expected = peer_auth.decode_proof(
            self.config.auth_token, peer.prefill_nonce, peer.decode_nonce
        )
        authenticated = peer_auth.proof_ok(expected, msg.proof)
        if not authenticated:
            reason = "authentication failed: wrong or missing transfer token"
        elif (reason := self.backend.register_problem(msg.backend)) is not None:
            pass
        else:
            reason = "; ".join(layout_mismatches(self.layout, msg.layout)) or None
            if reason is None:
                reason = self.plane.register_problem(peer, msg)
        if reason is not None:
            self.bad_messages.warning("rejected decode peer %s: %s", msg.decode_id, reason)
            self._reply(peer.key, RegisterRejected(reason))
            if authenticated:
                # NOTE: kept (until it expires) so its rooms fail with this reason, not a timeout.
                peer.rejected = reason
            else:  # NOTE: one that had registered loses its rooms now, not at their deadline
                self.drop_peer(peer, FailureKind.HANDSHAKE, reason if peer.registered else None)
            return
        peer.name, peer.registered = msg.decode_id, True
        peer.last_busy = time.monotonic()
        self._reply(peer.key, RegisterAck(self.prefill_id, self.instance))
        self.plane.registered(peer, msg)
