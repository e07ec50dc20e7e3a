"""The decode side of the handoff: one receiver per room, one connection per prefill peer.

The decode worker reserves pages first, then asks `receiver(room, host, port, pages)`. The
host must be inside the allow list (see peer_allow); we authenticate and register with that
prefill peer (see decode_peers), send the room's `TransferRequest`, and collect the KV (see the
data planes) and the metadata record into a receive buffer. Pages are written only by
`commit()`, on the caller's thread, after the room succeeded: a failed or aborted room never
wrote a page, so its pages can be freed at once.
"""

from __future__ import annotations

import time

import torch
import zmq

from pdserve.protocol.codec import ProtocolError
from pdserve.protocol.failures import Failure, FailureKind
from pdserve.protocol.metadata_spec import MetadataSpec
from pdserve.protocol.transfer_messages import (
    AbortRoom,
    KVLayout,
    MetadataHeader,
    RoomAck,
    RoomDone,
)
from pdserve.transfer.buffer_pool import BufferPool
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.decode_peers import PrefillPeers
from pdserve.transfer.endpoint import Endpoint
from pdserve.transfer.kv_staging import KVStager
from pdserve.transfer.metadata import MetadataMismatch, MetadataRecord
from pdserve.transfer.metrics import TransferMetrics
from pdserve.transfer.peer import Peer
from pdserve.transfer.peer_allow import zmq_endpoint
from pdserve.transfer.receiver_room import ReceiverRoom
from pdserve.transfer.room_state import RoomState, TransferState, room_failure


class DecodeTransferClient(PrefillPeers, Endpoint):
    side, peer_side = "decode", "prefill"
    sends_heartbeats = True

    def __init__(
        self,
        config: TransferConfig,
        layout: KVLayout,
        metadata_spec: MetadataSpec,
        decode_id: str,
        page_bytes: list[int],
        metrics: TransferMetrics | None = None,
        device: torch.device | None = None,
        tp_size: int = 1,
        ranks_host: str = "127.0.0.1",
        pools: list[torch.Tensor] | None = None,
    ):
        """page_bytes: bytes per page of the target pool with every KV head (and the draft
        pool if any). device: where received KV is staged (the GPU for nccl; CPU for tcp and
        gloo). tp_size: this worker's tensor-parallel size; over torch.distributed each rank
        receives its own KV heads (`head_slices`, `rank_fanout`), reporting to rank 0 at
        `ranks_host` (loopback unless the worker's ranks span nodes). pools: the `ipc`
        backend: the pools' storage tensors (target, then draft), which prefill writes into."""
        super().__init__(config, decode_id, metrics)
        self.layout = layout
        self.metadata_spec = metadata_spec
        self.decode_id = decode_id
        self.page_bytes = page_bytes
        self.allow_list = config.allow_list()
        self.device = device or torch.device("cpu")
        self.buffers = BufferPool(self.device)
        self._by_socket: dict[zmq.Socket, object] = {}
        self.start_fanout(tp_size, ranks_host)
        # Rooms that ended with a write of prefill's possibly in flight (`ipc`), by id.
        self.unsettled: dict[int, ReceiverRoom] = {}
        self.plane = self.backend.receive_plane(
            self, self.device, self.fanout, pools, metadata_spec.nbytes
        )

    def start(self) -> None:
        self.io.start(self._on_socket, self.tick, tick_s=0.05)

    def stop(self) -> None:
        self.io.stop()
        self.plane.close()
        for peer in self.peers.values():
            self.close_sockets(peer)
        self.context.term()
        self.doorbell.close()

    def receiver(
        self,
        room: int,
        host: str,
        port: int,
        page_ids: list[int],
        draft_page_ids: list[int] | None = None,
        num_cached_pages: int = 0,
    ) -> ReceiverRoom:
        """Start receiving `room` from the prefill worker at host:port into these pages; the
        first `num_cached_pages` of them hold their KV already (prefill skips them).
        PeerNotAllowed (a ValueError) if host is outside the allow list: nothing is sent."""
        address = zmq_endpoint(self.allow_list.resolve(host), port)
        draft_page_ids = list(draft_page_ids or [])
        if draft_page_ids and len(self.page_bytes) < 2:
            raise ValueError("draft pages given, but this worker has no draft KV pool")
        with self.lock:
            # NOTE: a kept room outlives its tombstone if a flood of rooms evicted it
            if room in self.rooms or room in self.unsettled or room in self.tombstones:
                raise ValueError(f"bootstrap_room {room} is already in use on this decode worker")
            state = RoomState(
                room,
                progress_timeout_s=self.config.progress_timeout_s,
                on_change=self.doorbell.ring,
            )
            receiver = ReceiverRoom(
                state,
                list(page_ids),
                draft_page_ids,
                self.page_bytes,
                num_cached_pages,
                queue_timeout_s=self.config.queue_timeout_s,
            )
            self.rooms[room] = receiver
        self.io.call(lambda: self._start_room(receiver, address))
        return Receiver(self, receiver)

    def release(self, room: int) -> None:
        """Forget a finished room; one whose pages a prefill write may still reach (`ipc`)
        is kept until prefill says its writes are over (`room_released`), or is gone."""
        with self.lock:
            receiver = self.rooms.pop(room, None)
            if receiver is None:
                return
            succeeded = receiver.poll() is TransferState.SUCCESS
            if not succeeded and self.plane.writes_pending(receiver):
                self.unsettled[room] = receiver
            else:
                self.plane.room_forgotten(receiver)

    def forget_unsettled(self, room: int) -> None:
        """The caller freed a room's pages: no write of prefill's can reach them any more."""
        with self.lock:
            receiver = self.unsettled.pop(room, None)
            if receiver is not None:
                self.plane.room_forgotten(receiver)

    def abort_room(self, room: int, host: str, port: int, kind: FailureKind, message: str) -> None:
        """Fail a room we never received into (we refused its request): tell its prefill
        (PeerNotAllowed if host is outside the allow list)."""
        address = zmq_endpoint(self.allow_list.resolve(host), port)
        with self.lock:
            self.tombstones.add(room)
        self.io.call(lambda: self._tell_abort(address, room, kind, message))

    # ---- IO thread -------------------------------------------------------------------

    def _start_room(self, receiver: ReceiverRoom, address: str) -> None:
        if receiver.done:
            return  # aborted before we got here
        peer = self._peer(address)
        if peer is None:
            message = f"no connection to prefill {address} (limit of {self.config.max_peers} "
            message += "prefill peers reached, or the connection failed)"
            failure = room_failure(message, FailureKind.PEER_LOST)
            self.fail_room(receiver, failure, notify=False)
            return
        self.attach(receiver, peer)
        self.deliver(peer, self._transfer_request(receiver))

    def _on_socket(self, socket: zmq.Socket) -> None:
        if self.on_fanout(socket) or self.plane.on_socket(socket):
            return
        peer = self._by_socket.get(socket)
        if peer is not None and socket is peer.monitor:
            self.on_monitor(peer)
            return
        while peer is not None and self.peers.get(peer.key) is peer:
            try:
                received = peer.channel.receive(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except ProtocolError as e:
                peer.last_seen = time.monotonic()
                self.malformed(peer, str(e))
                continue
            peer.last_seen = time.monotonic()
            payload = received.payload[0] if received.payload else None
            self.handle_message(peer, received.msg, payload)

    def handle_message(self, peer, msg, payload) -> None:
        """A message from a prefill peer: over its connection, or its lane (`ipc_lane`)."""
        if self._handshake(peer, msg) or self.plane.handle(peer, msg, payload):
            return
        room = self.room_of(peer, msg.room)
        if room is None:
            return  # late message for a finished, aborted or foreign room: ignore
        if isinstance(msg, AbortRoom):
            self.fail_room(room, self.peer_failure(msg.failure), notify=False)
        elif isinstance(msg, MetadataHeader):
            try:
                data = bytes(payload) if payload is not None else b""
                room.on_metadata(MetadataRecord.unpack(msg, data, self.metadata_spec))
            except MetadataMismatch as e:
                self.fail_room(room, room_failure(f"metadata mismatch: {e}"), notify=True)
        elif isinstance(msg, RoomDone):
            problem = room.on_done(msg.total_bytes, msg.num_pieces)
            if problem is not None:
                self.fail_room(room, problem, notify=True)
            else:
                self.room_landed(room)

    def room_released(self, peer, room_id: int) -> None:
        """The prefill worker's writes for this room are over (`ipc`)."""
        with self.lock:
            room = self.rooms.get(room_id) or self.unsettled.get(room_id)
            if room is None or not self.plane.writes_released(peer, room):
                return  # NOTE: by process: it may answer for a room of a lost connection
            if self.unsettled.pop(room_id, None) is not None:
                self.plane.room_forgotten(room)
        self.doorbell.ring()

    def room_landed(self, room: ReceiverRoom) -> None:
        """Bytes of `room` arrived: ack it if it is now complete."""
        if not room.complete_now():
            return  # pieces still landing, or RoomDone not seen yet
        self.metrics.succeeded(time.monotonic() - room.started_at)
        self.send(room.peer, RoomAck(room.room))
        self.end_room(room)

    def tick(self) -> None:
        super().tick()
        self._forget_settled()

    def _forget_settled(self) -> None:
        """Kept rooms whose writer is gone (and its writes with it) need not wait for its word,
        nor for the caller, which may have seen them settled first."""
        with self.lock:
            for room_id, room in list(self.unsettled.items()):
                if self.plane.pages_settled(room):
                    del self.unsettled[room_id]
                    self.plane.room_forgotten(room)

    def end_room(self, room, *, notify: bool = False) -> None:
        super().end_room(room, notify=notify)
        self.plane.room_ended(room)

    def recycle(self, buffers: list) -> None:
        for buffer in buffers:
            self.buffers.give(buffer)


class Receiver:
    """The decode worker's hold on one room (`DecodeTransferClient.receiver`): what its
    thread calls to abort the room or commit its KV, each step handed to the client, which
    alone changes the room (`ReceiverRoom`) otherwise. Reads from any thread."""

    def __init__(self, client: DecodeTransferClient, room: ReceiverRoom):
        self.client = client
        self.entry = room

    @property
    def room(self) -> int:
        return self.entry.room

    def poll(self) -> TransferState:
        return self.entry.poll()

    @property
    def done(self) -> bool:
        return self.entry.done

    @property
    def failure(self) -> Failure | None:
        return self.entry.failure

    @property
    def num_cached_pages(self) -> int:
        return self.entry.num_cached_pages

    @property
    def peer(self) -> Peer | None:
        return self.entry.peer

    @property
    def stamps(self) -> dict[str, float]:
        return self.entry.stamps

    def abort(self, kind: FailureKind, message: str) -> None:
        """Fail the room and tell prefill. The pages may be freed once `pages_settled`: right
        after this returns, but with the `ipc` backend (nothing else writes them before
        `commit`)."""
        room, client = self.entry, self.client
        room.fail(room_failure(message, kind))
        client.io.call(lambda: client.end_room(room, notify=True))

    def commit(self, stager: KVStager) -> MetadataRecord:
        """Write the received KV into this room's pages; call once, after SUCCESS."""
        record = self.entry.scatter(stager)
        self.client.recycle(self.entry.take_buffers())
        self.entry.stamp("commit_queued")
        return record

    @property
    def pages_settled(self) -> bool:
        """No write into the room's pages can still land, so they may be reused: always,
        but with a backend whose sender writes them (`ipc`) until the room succeeded, it
        said its writes are over, or it is gone."""
        if self.entry.poll() is TransferState.SUCCESS:
            return True
        with self.client.lock:
            return self.client.plane.pages_settled(self.entry)
