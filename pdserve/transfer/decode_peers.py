"""The decode side's connections to prefill workers: creation within a bound, the handshake,
re-registration after a prefill restart, non-blocking sends, and closing peers that fail.

Each prefill address gets one DEALER socket. A new connection first runs the challenge-
response (`Hello` -> `HelloReply` -> `Register`, see peer_auth): nothing else, least of all a
transfer request, goes out before the prefill worker proved it holds the token, so messages
meanwhile wait in `_Peer.waiting`. A prefill worker that does not know our connection (it
restarted, or forgot us while idle) answers `NotRegistered`; we then say Hello again and
send that room's request once more. Rooms whose request went to an earlier prefill instance
fail: that process is gone, and so is their KV. A peer that fails (bad proof, rejected
registration, silence, a full send queue) is closed and forgotten; nothing reconnects forever.
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
    TransferRequest,
)
from pdserve.transfer.outbox import Outbox, PeerBlocked
from pdserve.transfer.peer_auth import (
    NonceError,
    check_nonce,
    decode_proof,
    new_nonce,
    prefill_proof,
    proof_ok,
)
from pdserve.transfer.wire_limits import max_prefill_frame_bytes

logger = logging.getLogger(__name__)


@dataclass
class _Peer:
    address: str
    socket: zmq.Socket
    outbox: Outbox
    nonce: bytes = b""  # our Hello's nonce while the handshake is under way
    instance: int | None = None  # the prefill process we registered with
    registered: bool = False
    hello_at: float = field(default_factory=time.monotonic)
    waiting: list = field(default_factory=list)  # messages held until registered
    last_seen: float = field(default_factory=time.monotonic)
    last_heartbeat: float = 0.0
    last_used: float = field(default_factory=time.monotonic)
    rooms: set[int] = field(default_factory=set)


class PeerConnections:
    """Mixin of DecodeTransferClient: everything about peers; runs on the IO thread."""

    def _peer(self, address: str) -> _Peer | None:
        """The peer at this ZMQ endpoint, connected (and greeted) if new; None when the peer
        limit is reached and every peer is busy."""
        peer = self._peers.get(address)
        if peer is None:
            if len(self._peers) >= self.config.max_peers and not self._close_an_idle_peer():
                return None
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            frame_limit = max_prefill_frame_bytes(
                self.config.chunk_bytes, self.metadata_spec.nbytes
            )
            socket.setsockopt(zmq.MAXMSGSIZE, frame_limit)
            if address.startswith("tcp://["):
                socket.setsockopt(zmq.IPV6, 1)
            socket.connect(address)
            peer = _Peer(address, socket, Outbox(self.config.peer_timeout_s))
            self._peers[address] = peer
            self._by_socket[socket] = peer
            self.io.poller.register(socket, zmq.POLLIN)
            self._hello(peer)
        peer.last_used = time.monotonic()
        return peer if self._peers.get(address) is peer else None

    def _close_an_idle_peer(self) -> bool:
        idle = [p for p in self._peers.values() if not self._live_rooms(p)]
        if not idle:
            return False
        self._drop_peer(min(idle, key=lambda p: p.last_used), None)
        return True

    def _hello(self, peer: _Peer) -> None:
        peer.nonce, peer.registered, peer.hello_at = new_nonce(), False, time.monotonic()
        self._send(peer, Hello(self.decode_id, peer.nonce))

    def _deliver(self, peer: _Peer, msg) -> None:
        """Send once the peer is registered; hold it until then."""
        if not peer.registered:
            peer.waiting.append(msg)
            return
        if isinstance(msg, TransferRequest):
            room = self._rooms.get(msg.room)
            if room is not None:
                room._instance = peer.instance
        self._send(peer, msg)

    def _hello_reply(self, peer: _Peer, msg: HelloReply) -> None:
        if peer.registered or not peer.nonce:
            return  # not an answer to a Hello of ours
        try:
            check_nonce(msg.nonce)
        except NonceError as e:
            self._drop_peer(peer, f"handshake failed: {e}")
            return
        expected = prefill_proof(self.config.auth_token, peer.nonce, msg.nonce)
        if not proof_ok(expected, msg.proof):
            reason = (
                f"handshake failed: authentication failed: the prefill worker at {peer.address} "
                "did not prove it holds the transfer token"
            )
            self._drop_peer(peer, reason)
            return
        if peer.instance is not None and msg.instance != peer.instance:
            self._lost_to_restart(peer, msg.instance)
        peer.instance = msg.instance
        proof = decode_proof(self.config.auth_token, msg.nonce, peer.nonce)
        peer.nonce = b""
        self._send(peer, self._registration(peer, proof))
        peer.registered = True
        waiting, peer.waiting = peer.waiting, []
        for held in waiting:
            self._deliver(peer, held)

    def _registration(self, peer: _Peer, proof: bytes) -> Register:
        register = Register(self.decode_id, self.layout, proof, backend=self.config.backend)
        if self.dist is None:
            return register
        return self._with_pair(peer, register)

    def _lost_to_restart(self, peer: _Peer, instance: int) -> None:
        for room in self._live_rooms(peer):
            if room._instance is not None and room._instance != instance:
                self._fail(room, f"prefill worker at {peer.address} restarted; the room was lost")

    def _not_registered(self, peer: _Peer, msg: NotRegistered) -> None:
        """The prefill worker does not know this connection: greet it again, and send the
        refused room's request once more after that."""
        room = self._rooms.get(msg.room) if msg.room >= 0 else None
        if room is not None and not room._state.done and room._peer is peer:
            if room._retried:
                self._fail(room, f"prefill at {peer.address} refused the room twice")
            else:
                room._retried, room._instance = True, None
                peer.waiting.append(self._transfer_request(room))
        if peer.registered or not peer.nonce:
            self._hello(peer)

    def _send(self, peer: _Peer, msg) -> None:
        if self._peers.get(peer.address) is not peer:
            return  # closed meanwhile
        try:
            peer.outbox.send(peer.socket, [encode(msg)])
        except (PeerBlocked, zmq.ZMQError) as e:
            self._drop_peer(peer, f"prefill {peer.address} stopped taking messages: {e}")

    def _drop_peer(self, peer: _Peer, reason: str | None) -> None:
        """Close the connection and forget the peer; its live rooms fail with `reason`."""
        if self._peers.get(peer.address) is not peer:
            return
        for room in self._live_rooms(peer):
            self._fail(room, reason or "the prefill connection was closed")
        if reason is not None:
            self._peer_log.warning("closed the connection to prefill %s: %s", peer.address, reason)
        del self._peers[peer.address]
        del self._by_socket[peer.socket]
        self.io.poller.unregister(peer.socket)
        peer.outbox.clear()
        peer.socket.close(0)
        if self.dist is not None:
            self.dist.forget(peer.address)

    def _live_rooms(self, peer: _Peer) -> list:
        rooms = [self._rooms.get(r) for r in list(peer.rooms)]
        return [r for r in rooms if r is not None and not r._state.done]

    def _check_peers(self, now: float) -> None:
        """Flush send queues; close peers that stall, never finish the handshake, or stay
        idle (no rooms) for long."""
        idle_ttl = max(60.0, 12 * self.config.peer_timeout_s)
        for peer in list(self._peers.values()):
            try:
                peer.outbox.flush(peer.socket)
            except (PeerBlocked, zmq.ZMQError) as e:
                self._drop_peer(peer, f"prefill {peer.address} stopped taking messages: {e}")
                continue
            if not peer.registered and now - peer.hello_at > self.config.peer_timeout_s:
                waited = now - peer.hello_at
                reason = f"prefill peer {peer.address} silent for {waited:.1f} s (handshake)"
                self._drop_peer(peer, reason)
            elif not self._live_rooms(peer) and now - peer.last_used > idle_ttl:
                self._drop_peer(peer, None)
