"""What both sides of a handoff share (docs/architecture/transfer-states.md): the IO thread
that owns the ZMQ sockets, the rooms and their tombstones, the table of peer workers, and one
tick that flushes send queues, drops peers that fall silent, sends heartbeats and fails rooms
past their deadline.

`PrefillTransferServer` and `DecodeTransferClient` are endpoints; each adds its half of the
handshake, the messages it accepts and how a room starts. KV bytes move through the data
plane its backend builds (`backends/`). A room (`SenderRoom`, `ReceiverRoom`) is pure state
that changes only through its own methods and holds no reference back to its endpoint; the
worker's thread holds it through the endpoint's `Sender` / `Receiver`. Whatever goes wrong
with a room is a `Failure` (`fail_room(room, failure)`).

A peer's silence is measured from the last message it sent: a connection that has not
registered, or that serves live rooms, may be silent `peer_timeout_s`; an idle one is closed
quietly after a longer while. Attaching a room to a peer restarts its clock.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq

from pdserve.protocol.failures import Failure, FailureKind
from pdserve.protocol.log_limit import RateLimitedLog
from pdserve.protocol.transfer_messages import AbortRoom, Heartbeat
from pdserve.transfer.backends import make_backend
from pdserve.transfer.backends.dist.rank_fanout import RankFanout
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.doorbell import Doorbell
from pdserve.transfer.io_thread import IOThread
from pdserve.transfer.metrics import TransferMetrics
from pdserve.transfer.outbox import PeerBlocked
from pdserve.transfer.peer import Peer
from pdserve.transfer.room_state import Tombstones, room_failure

logger = logging.getLogger(__name__)

TICK_S = 0.05


class Endpoint:
    """Base of both sides. Subclasses set `side`/`peer_side`, `plane`, and implement
    `_socket_of`, `_frames` and `_closed`; everything under "IO thread" runs there."""

    side = ""
    peer_side = ""
    sends_heartbeats = False

    def __init__(self, config: TransferConfig, worker_id: str, metrics: TransferMetrics | None):
        self.config = config
        self.backend = make_backend(config)
        self.worker_id = worker_id
        self.metrics = metrics or TransferMetrics()
        self.context = zmq.Context()
        self.io = IOThread(f"{self.side}-transfer-{worker_id}", self.context)
        # Rung whenever a room changes state (see doorbell); the owner closes it at stop.
        self.doorbell = Doorbell()
        self.rooms: dict[int, Any] = {}
        # NOTE: guards `rooms` against the caller's thread, and makes "is there a room or a
        # tombstone for it" and what follows one step; the tombstones also lock themselves.
        self.lock = threading.Lock()
        self.tombstones = Tombstones(config.tombstone_ttl_s)
        self.peers: dict[Any, Peer] = {}
        self.plane: Any = None
        self.fanout: RankFanout | None = None
        self.bad_messages = RateLimitedLog(logger)
        self.peer_log = RateLimitedLog(logger)
        self.idle_ttl_s = max(60.0, 12 * config.peer_timeout_s)

    def start_fanout(self, tp_size: int, ranks_host: str) -> None:
        """A tensor-parallel worker over torch.distributed: where the orders for its other
        ranks queue and their reports arrive (`rank_fanout`); none otherwise."""
        if self.backend.per_rank and tp_size > 1:
            self.fanout = RankFanout(tp_size, self.context, ranks_host, self.doorbell)
            self.io.poller.register(self.fanout.reports.socket, zmq.POLLIN)

    def on_fanout(self, socket: zmq.Socket) -> bool:
        """IO thread: the ranks' reports, if `socket` is theirs (True)."""
        if self.fanout is None or socket is not self.fanout.reports.socket:
            return False
        self.plane.on_reports()
        return True

    def fail_all_rooms(self, kind: FailureKind, message: str) -> None:
        """Fail every live room and tell its peer (from any thread; runs on the IO thread)."""
        failure = room_failure(message, kind)

        def fail() -> None:
            with self.lock:
                rooms = list(self.rooms.values())
            for room in rooms:
                if not room.done:
                    self.fail_room(room, failure, notify=True)

        self.io.call(fail)

    def release(self, room: int) -> None:
        """Forget a finished room (its tombstone stays for late messages)."""
        with self.lock:
            self.rooms.pop(room, None)

    def release_unclaimed(self, room) -> None:
        """Forget a finished room that only a peer asked for (nobody else will); checked
        under the lock, so a room the caller's thread claims meanwhile stays."""
        with self.lock:
            if not room.claimed and self.rooms.get(room.room) is room:
                del self.rooms[room.room]

    # ---- IO thread -------------------------------------------------------------------

    def send(self, peer: Peer, msg, *payload, copy: bool = True) -> bool:
        """Send without blocking; False (and the peer dropped) if it cannot take it."""
        if self.peers.get(peer.key) is not peer:
            return False  # dropped meanwhile
        try:
            peer.outbox.send(self._socket_of(peer), self._frames(peer, msg, payload), copy=copy)
        except (PeerBlocked, zmq.ZMQError) as e:
            self.drop_peer(peer, FailureKind.PEER_LOST, f"stopped taking messages: {e}")
            return False
        return True

    def deliver(self, peer: Peer, msg) -> None:
        """Send a message about a room; a side whose connections register after they open
        (decode) holds it until then."""
        self.send(peer, msg)

    def attach(self, room, peer: Peer, *details) -> None:
        """`peer` asked for `room` (with the side's `details`): the room is its."""
        room.attach(peer, *details)
        peer.rooms.add(room.room)
        # NOTE: an idle peer's old silence does not count
        peer.last_seen = peer.last_busy = time.monotonic()

    def room_of(self, peer: Peer, room_id: int):
        """The live room `room_id` if it is `peer`'s; None for a late or foreign message."""
        room = self.rooms.get(room_id)
        if room is None or room.done or room.peer is not peer:
            return None
        return room

    def live_rooms(self, peer: Peer) -> list:
        rooms = (self.rooms.get(room_id) for room_id in list(peer.rooms))
        return [room for room in rooms if room is not None and not room.done]

    def fail_room(self, room, failure: Failure, *, notify: bool) -> None:
        """Fail `room` (the first failure stands), tell its peer if asked, and end it."""
        failed_now = room.fail(failure)
        self.end_room(room, notify=notify and failed_now)

    def end_room(self, room, *, notify: bool = False) -> None:
        """A room ended: tell its peer why (if asked), free its buffer, leave a tombstone."""
        if notify and room.peer is not None and room.failure is not None:
            self.deliver(room.peer, AbortRoom(room.room, room.failure))
        self.recycle(room.drop_buffers())
        self.tombstones.add(room.room, room.failure)
        if room.peer is not None:
            room.peer.rooms.discard(room.room)

    def recycle(self, buffers: list) -> None:
        """Buffers an ended room gave back (a side that pools them takes them)."""

    def drop_peer(self, peer: Peer, kind: FailureKind, reason: str | None) -> None:
        """Forget a peer and fail its live rooms (reason None: an idle peer closed quietly);
        a peer that comes back starts over, with a new link."""
        if self.peers.get(peer.key) is not peer:
            return
        del self.peers[peer.key]
        message = f"{self.peer_side} peer {peer} {reason or 'was closed'}"
        failure = room_failure(message, kind)
        for room in self.live_rooms(peer):
            self.fail_room(room, failure, notify=False)
        if reason is not None:
            self.peer_log.warning("dropped %s", message)
        peer.outbox.clear()
        self.plane.forget(peer)
        self._closed(peer)

    def peer_failure(self, failure: Failure) -> Failure:
        """A peer's failure as this side's: the request's fault stays so (INVALID), the peer's
        own trouble (INTERNAL, UNAVAILABLE) ended our room (ABORTED), the rest keep their
        kind; the message names the peer's side; the stage is the peer's."""
        kind = failure.kind
        if kind in (FailureKind.INTERNAL, FailureKind.UNAVAILABLE):
            kind = FailureKind.ABORTED
        message = failure.message
        if not message.startswith(self.peer_side):
            message = f"{self.peer_side}: {message}"
        return Failure(kind, failure.stage, message)

    def malformed(self, peer: Peer | None, problem: str) -> None:
        self.metrics.malformed_messages += 1
        name = f"{self.peer_side} peer {peer}" if peer is not None else f"a {self.peer_side} peer"
        self.bad_messages.warning("dropped a malformed message from %s: %s", name, problem)

    def tick(self) -> None:
        now = time.monotonic()
        for peer in list(self.peers.values()):
            self._check_peer(peer, now)
        with self.lock:
            rooms = list(self.rooms.values())
        for room in rooms:
            if room.done:
                if not room.claimed:
                    self.release_unclaimed(room)
            elif room.check_deadline():
                self.end_room(room, notify=True)
        self.plane.tick(now)

    def _check_peer(self, peer: Peer, now: float) -> None:
        try:
            peer.outbox.flush(self._socket_of(peer))
        except (PeerBlocked, zmq.ZMQError) as e:
            self.drop_peer(peer, FailureKind.PEER_LOST, f"stopped taking messages: {e}")
            return
        live = self.live_rooms(peer)
        idle = peer.registered and not live
        silent = now - peer.last_seen
        if silent > (self.idle_ttl_s if idle else self.config.peer_timeout_s):
            reason = None if idle else self.silence(peer, silent)
            self.drop_peer(peer, FailureKind.PEER_LOST, reason)
            return
        beat_due = now - peer.last_heartbeat >= self.config.heartbeat_interval_s
        if self.sends_heartbeats and live and peer.registered and beat_due:
            peer.last_heartbeat = now
            self.send(peer, Heartbeat(self.worker_id))

    def silence(self, peer: Peer, silent_s: float) -> str:
        """Why a peer that fell silent is dropped, as the log and its rooms' failures say."""
        return f"silent {silent_s:.1f} s"

    def _socket_of(self, peer: Peer) -> zmq.Socket:
        raise NotImplementedError

    def _frames(self, peer: Peer, msg, payload: tuple) -> list:
        raise NotImplementedError

    def _closed(self, peer: Peer) -> None:
        """After `drop_peer`: release what the side holds for the peer (e.g. its socket)."""
