"""The prefill side's decode peers: the handshake, registration, a bound on their number,
non-blocking sends, and dropping peers that fail, stall or fall silent.

A connection's entry is created by `Hello` only (at most `max_peers`; the oldest that has not
registered makes way). `Register` must carry decode's proof over both nonces (see peer_auth);
a wrong proof drops the entry, a layout mismatch keeps it marked rejected for a while so the
rooms it asks for fail with the reason rather than a timeout. Dropping a peer fails its rooms,
frees the KV buffers announced to it and closes its torch.distributed link.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import zmq

from pdserve.protocol.codec import encode
from pdserve.protocol.transfer_messages import (
    Hello,
    HelloReply,
    NotRegistered,
    Register,
    RegisterAck,
    RegisterRejected,
)
from pdserve.transfer.handshake import layout_mismatches
from pdserve.transfer.outbox import Outbox, PeerBlocked
from pdserve.transfer.peer_auth import (
    NonceError,
    check_nonce,
    decode_proof,
    new_nonce,
    prefill_proof,
    proof_ok,
)

logger = logging.getLogger(__name__)


@dataclass
class _Peer:
    decode_nonce: bytes
    prefill_nonce: bytes
    outbox: Outbox
    decode_id: str = ""
    registered: bool = False
    rejected: str | None = None  # proved the token, but its layout does not fit ours
    last_seen: float = field(default_factory=time.monotonic)


class PeerRegistry:
    """Mixin of PrefillTransferServer: everything about peers; runs on the IO thread."""

    def _hello(self, identity: bytes, msg: Hello) -> None:
        try:
            check_nonce(msg.nonce)
        except NonceError as e:
            self._malformed(str(e))
            return
        if identity not in self._peers and not self._make_room_for_a_peer():
            self._bad_messages.warning("refused a decode connection: %d peers", len(self._peers))
            return
        nonce = new_nonce()
        self._peers[identity] = _Peer(msg.nonce, nonce, Outbox(self.config.peer_timeout_s))
        proof = prefill_proof(self.config.auth_token, msg.nonce, nonce)
        self._reply(identity, HelloReply(self.prefill_id, self.instance, nonce, proof))

    def _make_room_for_a_peer(self) -> bool:
        """At the peer limit, forget the oldest connection that has not registered."""
        if len(self._peers) < self.config.max_peers:
            return True
        pending = [i for i, p in self._peers.items() if not p.registered]
        if not pending:
            return False
        oldest = min(pending, key=lambda i: self._peers[i].last_seen)
        del self._peers[oldest]
        return True

    def _register(self, identity: bytes, peer: _Peer, msg: Register) -> None:
        expected = decode_proof(self.config.auth_token, peer.prefill_nonce, peer.decode_nonce)
        authenticated = proof_ok(expected, msg.proof)
        if not authenticated:
            reason = "authentication failed: wrong or missing transfer token"
        elif msg.backend != self.config.backend:
            reason = f"transfer backend: prefill {self.config.backend!r} != decode {msg.backend!r}"
        else:
            reason = "; ".join(layout_mismatches(self.layout, msg.layout)) or None
        if reason is not None:
            self.metrics.failure("handshake")
            self._bad_messages.warning("rejected decode peer %s: %s", msg.decode_id, reason)
            self._reply(identity, RegisterRejected(reason))
            if authenticated:
                # NOTE: kept (until it expires) so its rooms fail with this reason, not a timeout.
                peer.rejected = reason
            else:
                del self._peers[identity]
            return
        peer.decode_id, peer.registered = msg.decode_id, True
        self._reply(identity, RegisterAck(self.prefill_id, self.instance))
        if self.dist is not None:
            self.dist.connect(
                identity,
                msg.store_address,
                msg.pair_name,
                lambda error: self.io.call(lambda: self._link_ready(identity, error)),
            )

    def _send_to(self, identity: bytes, frames: list, *, copy: bool = True) -> bool:
        """Send without blocking; False (and the peer dropped) if the peer cannot take it."""
        peer = self._peers.get(identity)
        if peer is None or not peer.registered:
            # NOTE: nothing is queued for a connection that has not registered.
            try:
                self._router.send_multipart([identity, *frames], zmq.NOBLOCK, copy=copy)
            except zmq.ZMQError:
                return False
            return True
        try:
            peer.outbox.send(self._router, [identity, *frames], copy=copy)
        except (PeerBlocked, zmq.ZMQError) as e:
            self._drop_peer(identity, f"decode peer {peer.decode_id} stopped taking messages: {e}")
            return False
        return True

    def _not_registered(self, identity: bytes, room: int) -> None:
        self._send_to(identity, [encode(NotRegistered(self.instance, room))])

    def _link_ready(self, identity: bytes, error: str | None) -> None:
        if error is not None:
            self._drop_peer(identity, error)

    def _drop_peer(self, identity: bytes, reason: str) -> None:
        """Forget a peer: fail its rooms, free the buffers announced to it, drop its link
        (a peer that comes back registers again, with a new link)."""
        peer = self._peers.pop(identity, None)
        if peer is not None:
            peer.outbox.clear()
            logger.warning("dropped decode peer %s: %s", peer.decode_id or "(unregistered)", reason)
        with self._lock:
            rooms = [room for room in self._rooms.values() if room.peer == identity]
        for room in rooms:
            self._abort_room(room, reason, notify=False)
        for room_id, (room, _, _) in list(self._announced.items()):
            if room.peer == identity:
                del self._announced[room_id]
        if self.dist is not None:
            self.dist.forget(identity)

    def _check_peers(self, now: float) -> None:
        for identity, peer in list(self._peers.items()):
            try:
                peer.outbox.flush(self._router)
            except (PeerBlocked, zmq.ZMQError) as e:
                self._drop_peer(identity, f"decode peer {peer.decode_id} stopped taking: {e}")
        self._expire_peers(now)

    def _expire_peers(self, now: float) -> None:
        """Drop peers silent too long: with live rooms after peer_timeout_s, without any
        (idle) after a longer while, and connections that never finished the handshake."""
        with self._lock:
            busy = {room.peer for room in self._rooms.values() if not room._state.done}
        idle_ttl = max(60.0, 12 * self.config.peer_timeout_s)
        for identity, peer in list(self._peers.items()):
            silent = now - peer.last_seen
            if not peer.registered:
                limit = self.config.peer_timeout_s
            else:
                limit = self.config.peer_timeout_s if identity in busy else idle_ttl
            if silent > limit:
                name = peer.decode_id or "(unregistered)"
                self._drop_peer(identity, f"decode peer {name} silent for {silent:.1f} s")
