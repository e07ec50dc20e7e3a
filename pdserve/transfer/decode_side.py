"""The decode side of the handoff: one receiver per room, one connection per prefill peer.

The decode worker reserves pages first, then asks `receiver(room, host, port, pages)`. The
host must be inside the allow list (see peer_allow); we authenticate and register with that
prefill peer (see decode_peers), send the room's `TransferRequest`, and collect KV chunks and
the metadata record into a receive buffer. Pages are written only by
`commit()`, on the caller's thread, after the room succeeded: a failed or aborted room never
wrote a page, so its pages can be freed at once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid

import torch
import zmq

from pdserve.protocol.codec import ProtocolError, decode
from pdserve.protocol.log_limit import RateLimitedLog
from pdserve.protocol.metadata_spec import MetadataSpec
from pdserve.protocol.transfer_messages import (
    AbortRoom,
    Heartbeat,
    HelloReply,
    KVChunk,
    KVLayout,
    MetadataHeader,
    NotRegistered,
    RecvPosted,
    Register,
    RegisterAck,
    RegisterRejected,
    RoomAck,
    RoomDone,
    SendReady,
    TransferRequest,
)
from pdserve.transfer.buffer_pool import BufferPool
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.decode_peers import PeerConnections, _Peer
from pdserve.transfer.dist_plane import DistPlane
from pdserve.transfer.io_thread import IOThread
from pdserve.transfer.metadata import MetadataMismatch, MetadataRecord
from pdserve.transfer.metrics import TransferMetrics
from pdserve.transfer.peer_allow import zmq_endpoint
from pdserve.transfer.receiver_room import ReceiverRoom
from pdserve.transfer.room_state import Tombstones, TransferState

logger = logging.getLogger(__name__)

_FROM_PREFILL = (
    HelloReply,
    NotRegistered,
    RegisterAck,
    RegisterRejected,
    KVChunk,
    MetadataHeader,
    RoomDone,
    AbortRoom,
    Heartbeat,
    SendReady,
)


class DecodeTransferClient(PeerConnections):
    def __init__(
        self,
        config: TransferConfig,
        layout: KVLayout,
        metadata_spec: MetadataSpec,
        decode_id: str,
        page_bytes: list[int],
        metrics: TransferMetrics | None = None,
        device: torch.device | None = None,
    ):
        """page_bytes: bytes per page of the target pool (and the draft pool if any).
        device: where received KV is staged (the GPU for nccl; CPU for tcp and gloo)."""
        self.config = config
        self.layout = layout
        self.metadata_spec = metadata_spec
        self.decode_id = decode_id
        self.page_bytes = page_bytes
        self.metrics = metrics or TransferMetrics()
        self.context = zmq.Context()
        self.io = IOThread(f"decode-transfer-{decode_id}", self.context)
        self._peers: dict[str, _Peer] = {}
        self._rooms: dict[int, ReceiverRoom] = {}
        self._by_socket: dict[zmq.Socket, _Peer] = {}
        self._tombstones = Tombstones(config.tombstone_ttl_s)
        self._lock = threading.Lock()
        self.allow_list = config.allow_list()
        self._bad_messages = RateLimitedLog(logger)
        self._peer_log = RateLimitedLog(logger)
        self.device = device or torch.device("cpu")
        self.buffers = BufferPool(self.device)
        self.dist: DistPlane | None = None
        if config.backend != "tcp":
            self.dist = DistPlane(
                config.backend,
                "decode",
                config.progress_timeout_s,
                self.device,
                config.bootstrap_host,
            )

    def start(self) -> None:
        self.io.start(self._on_socket, self._on_tick, tick_s=0.05)

    def stop(self) -> None:
        self.io.stop()
        if self.dist is not None:
            self.dist.close()
        for peer in self._peers.values():
            peer.socket.close(0)
        self.context.term()

    def receiver(
        self,
        room: int,
        host: str,
        port: int,
        page_ids: list[int],
        draft_page_ids: list[int] | None = None,
    ) -> ReceiverRoom:
        """Start receiving `room` from the prefill worker at host:port into these pages.
        PeerNotAllowed (a ValueError) if host is outside the allow list: nothing is sent."""
        address = zmq_endpoint(self.allow_list.resolve(host), port)
        draft_page_ids = list(draft_page_ids or [])
        counts = [len(page_ids), len(draft_page_ids)][: len(self.page_bytes)]
        expected = sum(n * size for n, size in zip(counts, self.page_bytes, strict=True))
        with self._lock:
            if room in self._rooms or room in self._tombstones:
                raise ValueError(f"bootstrap_room {room} is already in use on this decode worker")
            receiver = ReceiverRoom(self, room, None, list(page_ids), draft_page_ids, expected)
            self._rooms[room] = receiver
        self.io.call(lambda: self._start_room(receiver, address))
        return receiver

    def release(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def abort_room(self, room: int, host: str, port: int, reason: str) -> None:
        """Fail a room we never received into (we refused its request): tell its prefill
        (PeerNotAllowed if host is outside the allow list)."""
        address = zmq_endpoint(self.allow_list.resolve(host), port)
        with self._lock:
            self._tombstones.add(room)

        def tell() -> None:
            peer = self._peer(address)
            if peer is not None:
                self._deliver(peer, AbortRoom(room, reason))

        self.io.call(tell)

    # ---- IO thread -------------------------------------------------------------------

    def _with_pair(self, peer: _Peer, register: Register) -> Register:
        """Registration for torch.distributed backends: our store and a new pair group."""
        store = self.dist.serve_store(self.config.bootstrap_host)
        pair = f"pair/{self.decode_id}/{uuid.uuid4().hex[:12]}"

        def on_link(error: str | None) -> None:
            if error:
                self.io.call(lambda: self._drop_peer(peer, error))

        self.dist.connect(peer.address, store, pair, on_link)
        return dataclasses.replace(register, store_address=store, pair_name=pair)

    def _start_room(self, receiver: ReceiverRoom, address: str) -> None:
        if receiver._state.done:
            return  # aborted before we got here
        peer = self._peer(address)
        if peer is None:
            reason = f"no connection to prefill {address} (limit of {self.config.max_peers} "
            self._fail(receiver, reason + "prefill peers reached, or the connection failed)")
            return
        receiver._peer = peer
        peer.rooms.add(receiver.room)
        self._deliver(peer, self._transfer_request(receiver))

    def _transfer_request(self, receiver: ReceiverRoom) -> TransferRequest:
        return TransferRequest(receiver.room, receiver.page_ids, receiver.draft_page_ids)

    def _on_socket(self, socket: zmq.Socket) -> None:
        peer = self._by_socket.get(socket)
        if peer is None:
            return  # closed earlier in this turn of the loop
        while True:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer.last_seen = time.monotonic()
            try:
                msg = decode(frames[0].bytes, _FROM_PREFILL)
            except ProtocolError as e:
                self.metrics.failure("malformed_message")
                self._bad_messages.warning(
                    "dropped a malformed message from prefill %s: %s", peer.address, e
                )
                continue
            self._handle(peer, msg, frames[1] if len(frames) > 1 else None)
            if self._peers.get(peer.address) is not peer:
                return  # the message closed this peer

    def _handle(self, peer: _Peer, msg, payload) -> None:
        if isinstance(msg, HelloReply):
            self._hello_reply(peer, msg)
            return
        if isinstance(msg, NotRegistered):
            self._not_registered(peer, msg)
            return
        if isinstance(msg, RegisterRejected):
            self._drop_peer(peer, f"handshake failed: {msg.reason}")
            return
        if isinstance(msg, (RegisterAck, Heartbeat)):
            return
        if isinstance(msg, SendReady):
            self._send_ready(peer, msg)
            return
        room = self._rooms.get(msg.room)
        if room is None or room._state.done or room._peer is not peer:
            return  # late message for a finished, aborted or foreign room: ignore
        if isinstance(msg, AbortRoom):
            self._fail(room, f"prefill aborted: {msg.reason}")
        elif isinstance(msg, KVChunk):
            self._chunk(room, msg, payload)
        elif isinstance(msg, MetadataHeader):
            self._metadata(room, msg, payload)
        elif isinstance(msg, RoomDone):
            self._done(room, msg)

    def _chunk(self, room: ReceiverRoom, msg: KVChunk, payload) -> None:
        # NOTE: every bound is checked against our own reservation before a byte is copied.
        size = len(payload) if payload is not None else -1
        if (
            msg.offset != room._received
            or size != msg.nbytes
            or msg.offset + msg.nbytes > room.expected_bytes
        ):
            self._fail(
                room,
                f"bad KV chunk (offset {msg.offset}, {msg.nbytes} bytes, payload "
                f"{size}, expected offset {room._received} of "
                f"{room.expected_bytes})",
                notify=True,
            )
            return
        if room._buffer is None:
            room._buffer = self.buffers.take(room.expected_bytes)
            room._state.advance(TransferState.TRANSFERRING)
        target = room._buffer[msg.offset : msg.offset + msg.nbytes]
        target.copy_(torch.frombuffer(payload.buffer, dtype=torch.uint8))
        room._received += msg.nbytes
        self.metrics.bytes_received += msg.nbytes

    def _send_ready(self, peer: _Peer, msg: SendReady) -> None:
        """Post the receive (torch.distributed backends), then tell prefill to send. A room we
        no longer want still gets a receive, into scratch: the pair's order must hold."""
        room = self._rooms.get(msg.room)
        live = room is not None and not room._state.done and room._peer is peer
        # NOTE: bounds before allocating: a live room takes exactly what we reserved; anything
        # else is capped by what our whole reservation could hold.
        if live and msg.nbytes != room.expected_bytes:
            self._fail(
                room,
                f"prefill announced {msg.nbytes} bytes of KV, we reserved {room.expected_bytes}",
                notify=True,
            )
            live = False
        if not live and msg.nbytes > self._scratch_limit():
            logger.error(
                "prefill %s announced %d bytes for room %d; dropping the link",
                peer.address,
                msg.nbytes,
                msg.room,
            )
            self._drop_peer(peer, "prefill announced an oversize transfer")
            return
        if live:
            room.stamps["send_ready_seen"] = time.monotonic()
        buffer = self.buffers.take(msg.nbytes)
        if live:
            room._recv_in_flight = True
            if room._state.state is TransferState.BOOTSTRAPPING:
                room._state.advance(TransferState.TRANSFERRING)

        def posted() -> None:
            if live:
                room.stamps["recv_posted"] = time.monotonic()
            self.io.call(lambda: self._send(peer, RecvPosted(msg.room)))

        def done(error: str | None) -> None:
            self.io.call(lambda: self._received(peer, room if live else None, buffer, error))

        self.dist.receive(peer.address, buffer, posted, done)

    def _received(self, peer: _Peer, room: ReceiverRoom | None, buffer, error) -> None:
        if error is not None:
            # NOTE: the link was torn down, so nothing can still write into the buffer.
            self.buffers.give(buffer)
            self._drop_peer(peer, error)
            return
        if room is None or room._state.done:
            self.buffers.give(buffer)  # scratch receive for a room we had dropped
            return
        room.stamps["recv_done_seen"] = time.monotonic()
        room._recv_in_flight = False
        room._buffer = buffer
        room._received = buffer.numel()
        self.metrics.bytes_received += buffer.numel()
        if room._deferred_done is not None:
            self._done(room, room._deferred_done)
        elif room.metadata is not None:
            # The metadata came before the data (see prefill's _send_room): the completed
            # receive is the whole room, no need to wait for RoomDone.
            self._done(room, RoomDone(room.room, buffer.numel()))

    def _scratch_limit(self) -> int:
        return max((r.expected_bytes for r in self._rooms.values()), default=0)

    def _metadata(self, room: ReceiverRoom, msg: MetadataHeader, payload) -> None:
        try:
            data = payload.bytes if payload is not None else b""
            room.metadata = MetadataRecord.unpack(msg, data, self.metadata_spec)
        except MetadataMismatch as e:
            self._fail(room, f"metadata mismatch: {e}", notify=True)

    def _done(self, room: ReceiverRoom, msg: RoomDone) -> None:
        if room._recv_in_flight:
            room._deferred_done = msg  # the bytes are still arriving on the data thread
            return
        if msg.total_bytes != room.expected_bytes or room._received != room.expected_bytes:
            self._fail(
                room,
                f"incomplete KV: got {room._received} of {room.expected_bytes} "
                f"bytes (prefill sent {msg.total_bytes})",
                notify=True,
            )
            return
        if room.metadata is None:
            self._fail(room, "room finished without its metadata record", notify=True)
            return
        if room._state.state is TransferState.BOOTSTRAPPING:
            room._state.advance(TransferState.TRANSFERRING)  # zero-byte KV
        room._state.advance(TransferState.SUCCESS)
        room.stamps["success"] = time.monotonic()
        self.metrics.succeeded(time.monotonic() - room.started_at)
        self._send(room._peer, RoomAck(room.room))
        self._end(room)

    def _fail(self, room: ReceiverRoom, reason: str, *, notify: bool = False) -> None:
        if room._state.fail(reason):
            self.metrics.failure(reason.split(":")[0])
        if notify and room._peer is not None:
            self._deliver(room._peer, AbortRoom(room.room, reason))
        self._drop_buffer(room)
        self._end(room)

    def _drop_buffer(self, room: ReceiverRoom) -> None:
        """Recycle a failed room's buffer, unless a posted receive may still write into it
        (then `_received` recycles it when that receive ends)."""
        if room._buffer is not None and not room._recv_in_flight:
            self.buffers.give(room._buffer)
        room._buffer = None

    def _send_abort(self, room: ReceiverRoom, reason: str) -> None:
        self._drop_buffer(room)
        if room._peer is not None and self._peers.get(room._peer.address) is room._peer:
            self._deliver(room._peer, AbortRoom(room.room, reason))
        self._end(room)

    def _end(self, room: ReceiverRoom) -> None:
        self._tombstones.add(room.room)
        if room._peer is not None:
            room._peer.rooms.discard(room.room)

    def _on_tick(self) -> None:
        now = time.monotonic()
        self._check_peers(now)
        for peer in list(self._peers.values()):
            live = self._live_rooms(peer)
            if not live:
                peer.last_seen = now  # nothing to wait for: silence is fine
                continue
            if now - peer.last_seen > self.config.peer_timeout_s:
                silent = now - peer.last_seen
                self._drop_peer(peer, f"prefill peer {peer.address} silent for {silent:.1f} s")
                continue
            if peer.registered and now - peer.last_heartbeat >= self.config.heartbeat_interval_s:
                peer.last_heartbeat = now
                self._send(peer, Heartbeat(self.decode_id))
            for room in live:
                if room._state.check_deadline():
                    self.metrics.failure("timeout")
                    self._deliver(peer, AbortRoom(room.room, room.failure_reason))
                    self._drop_buffer(room)
                    self._end(room)
