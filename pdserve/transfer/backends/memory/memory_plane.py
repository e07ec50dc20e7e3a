"""KV handed over inside one process (the `memory` backend): the sender registers each piece's
buffer in the process-wide `piece_registry` and announces it (`KVPiece`) on the control
connection, with no bytes after it; the receiver checks the announcement against its own
reservation exactly as over tcp (`ReceiverRoom.on_piece`, then `chunk_target` for the
whole piece: bounds before a byte is allocated), takes the buffer from the registry and copies it
into the piece's receive buffer. The metadata record and `RoomDone` follow the last piece.

Nothing stays behind: the receiver takes every piece it reads an announcement of, and drops
what is left of a room when it ends there; the sender withdraws the bytes of a room that
ended on its side (at its next tick) and of a connection it dropped. The handshake checks
that both workers are one process: host, PID namespace and process id (`HelloReply`'s and
`Register`'s `host_id` and `pid`), and that the prefill instance has a plane in this
process's registry. The interface is `data_plane`'s.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from pdserve.protocol.failures import Failure
from pdserve.protocol.transfer_messages import HelloReply, KVPiece, Register
from pdserve.transfer.backends.ipc.shared_pools import host_id
from pdserve.transfer.backends.memory.piece_registry import REGISTRY, WITHDRAWN, PieceRegistry
from pdserve.transfer.data_plane import DataPlane
from pdserve.transfer.kv_piece import OutgoingPiece
from pdserve.transfer.room_state import room_failure

if TYPE_CHECKING:
    from pdserve.transfer.endpoint import Endpoint
    from pdserve.transfer.peer import Peer

OTHER_PROCESS = (
    "the memory backend hands KV over inside one process, so both workers must run in it "
    "(tests): use --transfer-backend tcp between processes"
)


class _MemoryPlane(DataPlane):
    def __init__(self, endpoint: Endpoint, registry: PieceRegistry):
        self.endpoint = endpoint
        self.registry = registry
        self.process = (host_id(), os.getpid())

    def other_process(self, host: str, pid: int) -> str | None:
        """Why a peer of this host and process id is not in our process, if it is not."""
        return OTHER_PROCESS if (host, pid) != self.process else None


class MemorySendPlane(_MemoryPlane):
    """The prefill side: registers pieces and announces them."""

    def __init__(self, endpoint: Endpoint, registry: PieceRegistry = REGISTRY):
        super().__init__(endpoint, registry)
        self.sender = endpoint.instance
        registry.open_sender(self.sender)

    def hello_reply(self, reply: HelloReply) -> HelloReply:
        host, pid = self.process
        return dataclasses.replace(reply, host_id=host, pid=pid)

    def register_problem(self, peer: Peer, msg: Register) -> str | None:
        return self.other_process(msg.host_id, msg.pid)

    def send_piece(self, room, piece: OutgoingPiece, index: int) -> bool:
        """Register the piece, then announce it (IO thread); False if it could not go (the
        room failed, or the peer was dropped)."""
        endpoint, owner = self.endpoint, room.peer.decode_nonce
        problem = self.registry.put(self.sender, room.room, index, piece.data, owner)
        if problem is not None:
            endpoint.fail_room(room, room_failure(problem), notify=True)
            return False
        if not endpoint.send(room.peer, piece.announcement(room.room, index)):
            self.registry.take(self.sender, room.room, index, owner)  # NOTE: never announced
            return False
        endpoint.metrics.bytes_sent += piece.nbytes
        return True

    def tick(self, now: float) -> None:
        """Withdraw the bytes of rooms that ended here."""
        with self.endpoint.lock:
            live = {room.room for room in self.endpoint.rooms.values() if not room.done}
        self.registry.withdraw(self.sender, live)

    def forget(self, peer: Peer) -> None:
        self.registry.withdraw_owner(self.sender, peer.decode_nonce)

    def close(self) -> None:
        self.registry.close_sender(self.sender)


class MemoryReceivePlane(_MemoryPlane):
    """The decode side: takes announced pieces from the registry."""

    def __init__(self, endpoint: Endpoint, registry: PieceRegistry = REGISTRY):
        super().__init__(endpoint, registry)
        # Each prefill peer's connection as the registry knows it: our Hello's nonce.
        self._owners: dict[str, bytes] = {}

    def hello_problem(self, peer: Peer, msg: HelloReply) -> str | None:
        problem = self.other_process(msg.host_id, msg.pid)
        if problem is None and not self.registry.has_sender(msg.instance):
            problem = f"prefill instance {msg.instance} has no memory plane in this process"
        if problem is None:
            self._owners[peer.key] = peer.nonce
        return problem

    def registration(self, peer: Peer, register: Register) -> Register:
        host, pid = self.process
        return dataclasses.replace(register, host_id=host, pid=pid)

    def handle(self, peer: Peer, msg, payload) -> bool:
        """A piece announced by `peer`; False for other messages."""
        if not isinstance(msg, KVPiece):
            return False
        endpoint = self.endpoint
        owner = self._owners.get(peer.key)
        # NOTE: taken even for a room that ended here: nothing stays behind once read.
        data = self.registry.take(peer.instance, msg.room, msg.index, owner)
        room = endpoint.room_of(peer, msg.room)
        if room is None or data is WITHDRAWN:
            return True  # a room that ended on either side (prefill's reason follows)
        problem = self._land(room, msg, data)
        if problem is not None:
            endpoint.fail_room(room, problem, notify=True)
        return True

    def _land(self, room, msg: KVPiece, data) -> Failure | None:
        """Check the piece against the room's reservation, then copy it into the room's
        buffer; what is wrong with it, if anything. NOTE: copied, not adopted: a receive
        buffer is the room's own (from its pool, given back at the commit), and `on_piece`
        is where every backend's pieces are checked and given one."""
        if data is None:
            return room_failure(
                f"KV piece {msg.index} was announced, but prefill registered no such piece"
            )
        problem = room.on_piece(msg, self.endpoint.buffers.take)
        if problem is not None:
            return problem
        target = room.chunk_target(msg.index, 0, msg.nbytes)
        if isinstance(target, Failure):
            return target
        if data.numel() != msg.nbytes:
            return room_failure(
                f"KV piece {msg.index} announced {msg.nbytes} bytes, registered {data.numel()}"
            )
        target.copy_(data)
        room.chunk_landed(msg.index, msg.nbytes)
        self.endpoint.metrics.bytes_received += msg.nbytes
        return None

    def room_ended(self, room) -> None:
        peer = room.peer
        if peer is not None and peer.instance is not None:
            self.registry.drop_room(peer.instance, room.room, self._owners.get(peer.key))

    def forget(self, peer: Peer) -> None:
        owner = self._owners.pop(peer.key, None)
        if peer.instance is not None and owner is not None:
            self.registry.drop_owner(peer.instance, owner)

    def close(self) -> None:
        for peer in self.endpoint.peers.values():
            self.forget(peer)
