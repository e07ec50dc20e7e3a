"""The decode side's connections to prefill workers: creation within a bound, the handshake,
and registering again after a prefill restart.

Each prefill address gets one DEALER socket. A new connection first runs the challenge-
response (`Hello` -> `HelloReply` -> `Register`, see peer_auth): nothing else, least of all a
transfer request, goes out before the prefill worker proved it holds the token, so messages
meanwhile wait in `PrefillPeer.waiting`. A prefill worker that does not know our connection
(it restarted, or forgot us while idle) answers `NotRegistered`; we then say Hello again and
send that room's request once more. Rooms whose request went to an earlier prefill instance
fail: that process is gone, and so is their KV. A peer that fails (bad proof, rejected
registration, silence, a full send queue) is closed and forgotten; nothing reconnects forever.

A prefill worker whose bootstrap port has too many connections refuses ours at its ZMTP
handshake (bootstrap_connections), and libzmq then never tries again: a monitor on each
connection sees that refusal, and the peer is dropped at once with its rooms, by name, so the
next room makes a fresh connection.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

from pdserve.protocol.channel import Channel
from pdserve.protocol.failures import Failure, FailureKind, FailureStage
from pdserve.protocol.transfer_messages import (
    AbortRoom,
    Heartbeat,
    Hello,
    HelloReply,
    KVChunk,
    KVPiece,
    MetadataHeader,
    NotRegistered,
    Register,
    RegisterAck,
    RegisterRejected,
    RoomDone,
    RoomReleased,
    TransferRequest,
)
from pdserve.transfer import peer_auth
from pdserve.transfer.outbox import Outbox
from pdserve.transfer.peer import Peer
from pdserve.transfer.room_state import room_failure
from pdserve.transfer.wire_limits import max_prefill_frame_bytes

# What a prefill worker sends us.
FROM_PREFILL = (
    HelloReply,
    NotRegistered,
    RegisterAck,
    RegisterRejected,
    KVChunk,
    MetadataHeader,
    RoomDone,
    AbortRoom,
    Heartbeat,
    KVPiece,
    RoomReleased,
)
# NOTE: the only handshake a prefill worker refuses (ZAP status 400 under ZMTP's NULL
# mechanism: libzmq passes on the status, not its text) is one past its connection bounds.
REFUSED_AT_HANDSHAKE = (
    "refused the connection at its handshake: too many connections to its bootstrap port"
)


@dataclass
class PrefillPeer(Peer):
    channel: Channel | None = None
    monitor: zmq.Socket | None = None  # its connection's handshake refusals
    nonce: bytes = b""  # our Hello's nonce while the handshake is under way
    instance: int | None = None  # the prefill process we registered with
    waiting: list = field(default_factory=list)  # messages held until registered


class PrefillPeers:
    """Mixin of DecodeTransferClient (an Endpoint): connections and the handshake; runs on
    the IO thread."""

    def _peer(self, address: str) -> PrefillPeer | None:
        """The peer at this ZMQ endpoint, connected (and greeted) if new; None when the peer
        limit is reached and every peer is busy."""
        peer = self.peers.get(address)
        if peer is not None:
            return peer
        if len(self.peers) >= self.config.max_peers and not self._close_an_idle_peer():
            return None
        frame_limit = max_prefill_frame_bytes(self.config.chunk_bytes, self.metadata_spec.nbytes)
        channel = Channel(
            self.context,
            zmq.DEALER,
            FROM_PREFILL,
            max_payload_frames=1,  # a KV chunk's bytes, or a metadata record's tensors
            max_message_bytes=frame_limit,
        )
        monitor = self._watch_handshakes(channel.socket)
        channel.connect(address)
        peer = PrefillPeer(
            address, Outbox(self.config.peer_timeout_s), channel=channel, monitor=monitor
        )
        self.peers[address] = peer
        self._by_socket[channel.socket] = self._by_socket[monitor] = peer
        self.io.poller.register(channel.socket, zmq.POLLIN)
        self.io.poller.register(monitor, zmq.POLLIN)
        self._hello(peer)
        return peer if self.peers.get(address) is peer else None

    def _watch_handshakes(self, socket: zmq.Socket) -> zmq.Socket:
        """A monitor of `socket`'s refused handshakes, connected before `socket` connects (so
        that it misses none)."""
        address = f"inproc://prefill-peer-monitor-{uuid.uuid4().hex}"
        socket.monitor(address, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        monitor = self.context.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(address)
        return monitor

    def on_monitor(self, peer: PrefillPeer) -> None:
        """The peer's connection was refused at its handshake: fail its rooms now."""
        while self.peers.get(peer.key) is peer:
            try:
                event = parse_monitor_message(peer.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.drop_peer(peer, FailureKind.HANDSHAKE, REFUSED_AT_HANDSHAKE)

    def close_sockets(self, peer: PrefillPeer) -> None:
        with contextlib.suppress(zmq.ZMQError):
            peer.channel.socket.disable_monitor()
        peer.monitor.close(0)
        peer.channel.close()

    def _close_an_idle_peer(self) -> bool:
        idle = [p for p in self.peers.values() if not self.live_rooms(p)]
        if not idle:
            return False
        self.drop_peer(min(idle, key=lambda p: p.last_seen), FailureKind.PEER_LOST, None)
        return True

    def _socket_of(self, peer: PrefillPeer) -> zmq.Socket:
        return peer.channel.socket

    def _frames(self, peer: PrefillPeer, msg, payload: tuple) -> list:
        return peer.channel.frames(msg, *payload)

    def _closed(self, peer: PrefillPeer) -> None:
        for socket in (peer.channel.socket, peer.monitor):
            del self._by_socket[socket]
            self.io.poller.unregister(socket)
        self.close_sockets(peer)

    def _hello(self, peer: PrefillPeer) -> None:
        peer.nonce, peer.registered = peer_auth.new_nonce(), False
        self.send(peer, Hello(self.decode_id, peer.nonce))

    def deliver(self, peer: PrefillPeer, msg) -> None:
        """Send once the peer is registered; hold it until then."""
        if not peer.registered:
            peer.waiting.append(msg)
            return
        if isinstance(msg, TransferRequest):
            with self.lock:
                room = self.rooms.get(msg.room)
                if not self.plane.admit_request(peer, room):
                    return  # NOTE: e.g. its pages may be free already: nobody may write them
                if room is not None:
                    room.sent_to(peer.instance)
        self.send(peer, msg)

    def _transfer_request(self, receiver) -> TransferRequest:
        num_pages, num_draft = len(receiver.page_ids), len(receiver.draft_page_ids)
        request = TransferRequest(receiver.room, num_pages, num_draft, receiver.num_cached_pages)
        return self.backend.transfer_request(request, receiver)

    def _tell_abort(self, address: str, room: int, kind: FailureKind, message: str) -> None:
        peer = self._peer(address)
        if peer is not None:
            self.deliver(peer, AbortRoom(room, Failure(kind, FailureStage.BOOTSTRAP, message)))

    def _handshake(self, peer: PrefillPeer, msg) -> bool:
        """Handle a handshake or liveness message; False for any other."""
        if isinstance(msg, HelloReply):
            self._hello_reply(peer, msg)
        elif isinstance(msg, NotRegistered):
            self._not_registered(peer, msg)
        elif isinstance(msg, RegisterRejected):
            self.drop_peer(peer, FailureKind.HANDSHAKE, f"handshake failed: {msg.reason}")
        return isinstance(
            msg, (HelloReply, NotRegistered, RegisterRejected, RegisterAck, Heartbeat)
        )

    def _hello_reply(self, peer: PrefillPeer, msg: HelloReply) -> None:
        if peer.registered or not peer.nonce:
            return  # not an answer to a Hello of ours
        try:
            peer_auth.check_nonce(msg.nonce)
        except peer_auth.NonceError as e:
            self.drop_peer(peer, FailureKind.HANDSHAKE, f"handshake failed: {e}")
            return
        expected = peer_auth.prefill_proof(self.config.auth_token, peer.nonce, msg.nonce)
        if not peer_auth.proof_ok(expected, msg.proof):
            reason = (
                "handshake failed: authentication failed: it did not prove it holds the "
                "transfer token"
            )
            self.drop_peer(peer, FailureKind.HANDSHAKE, reason)
            return
        if peer.instance is not None and msg.instance != peer.instance:
            for room in self.live_rooms(peer):
                if room.instance is not None and room.instance != msg.instance:
                    message = f"prefill worker at {peer.key} restarted; the room was lost"
                    self.fail_room(room, room_failure(message, FailureKind.PEER_LOST), notify=False)
        problem = self.plane.hello_problem(peer, msg)
        if problem is not None:
            self.drop_peer(peer, FailureKind.HANDSHAKE, f"handshake failed: {problem}")
            return
        peer.instance = msg.instance
        proof = peer_auth.decode_proof(self.config.auth_token, msg.nonce, peer.nonce)
        peer.nonce = b""
        register = Register(self.decode_id, self.layout, proof, backend=self.config.backend)
        self.send(peer, self.plane.registration(peer, register))
        peer.registered = True
        waiting, peer.waiting = peer.waiting, []
        for held in waiting:
            self.deliver(peer, held)
        self._ask_about_unsettled(peer)

    def _ask_about_unsettled(self, peer: PrefillPeer) -> None:
        """Rooms whose pages this prefill process may still write (`ipc`), whose connection
        was lost: abort them again on this one, which prefill answers with `RoomReleased` once
        their writes are over."""
        with self.lock:
            unsettled = self.unsettled.values()
            rooms = [r for r in unsettled if r.failure and self.plane.writes_pending(r, peer)]
        for room in rooms:
            self.send(peer, AbortRoom(room.room, room.failure))

    def _not_registered(self, peer: PrefillPeer, msg: NotRegistered) -> None:
        """The prefill worker does not know this connection: greet it again, and send the
        refused room's request once more after that."""
        room = self.room_of(peer, msg.room) if msg.room >= 0 else None
        if room is not None:
            if room.retry():
                peer.waiting.append(self._transfer_request(room))
            else:
                message = f"prefill at {peer.key} refused the room twice"
                self.fail_room(room, room_failure(message, FailureKind.PEER_LOST), notify=False)
        if peer.registered or not peer.nonce:
            self._hello(peer)
