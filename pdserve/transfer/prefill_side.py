"""The prefill side of the handoff: the bootstrap endpoint and one sender per room.

A decode worker connects (DEALER) to our bootstrap ROUTER, registers once (layout, token),
then sends a `TransferRequest` per room once it reserved pages. The prefill worker asks
`sender(room)`, computes only after the room reached WAITING_FOR_INPUT (decode's pages exist),
then `send()`s the KV buffer and the metadata record; the room succeeds when decode acks it.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from dataclasses import dataclass, field

import torch
import zmq

from pdserve.protocol.codec import ProtocolError, decode, encode
from pdserve.protocol.transfer_messages import (
    AbortRoom,
    Heartbeat,
    KVChunk,
    KVLayout,
    RecvPosted,
    Register,
    RegisterAck,
    RegisterRejected,
    RoomAck,
    RoomDone,
    SendReady,
    TransferRequest,
)
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.dist_plane import DistPlane
from pdserve.transfer.handshake import layout_mismatches
from pdserve.transfer.io_thread import IOThread
from pdserve.transfer.metadata import MetadataRecord
from pdserve.transfer.metadata_spec import MetadataSpec
from pdserve.transfer.metrics import TransferMetrics
from pdserve.transfer.room_state import RoomState, Tombstones, TransferState

logger = logging.getLogger(__name__)

_FROM_DECODE = (Register, TransferRequest, AbortRoom, RoomAck, Heartbeat, RecvPosted)


@dataclass
class _Peer:
    decode_id: str = ""
    rejected: str | None = None
    last_seen: float = field(default_factory=time.monotonic)


class SenderRoom:
    """One room on the prefill side. State reads are safe from any thread."""

    def __init__(self, server: PrefillTransferServer, room: int, state: RoomState):
        self._server = server
        self.room = room
        self._state = state
        self.peer: bytes | None = None
        self.decode_page_ids: list[int] = []
        self.draft_page_ids: list[int] = []
        self._buffer: torch.Tensor | None = None
        self.started_at = time.monotonic()
        # When each protocol step happened (monotonic clock), for latency breakdowns.
        self.stamps: dict[str, float] = {}

    def poll(self) -> TransferState:
        return self._state.state

    @property
    def failure_reason(self) -> str | None:
        return self._state.failure_reason

    def send(self, kv: torch.Tensor, metadata: MetadataRecord) -> None:
        """Send the request's gathered KV (flat uint8: on the CPU for tcp and gloo, on the GPU
        for nccl) and its metadata record."""
        wanted = "cpu" if self._server.config.backend in ("tcp", "gloo") else "cuda"
        if kv.dtype != torch.uint8 or kv.device.type != wanted or not kv.is_contiguous():
            raise ValueError(
                f"kv must be a contiguous uint8 buffer on {wanted} (see KVStager.gather)"
            )
        header, payload = metadata.pack(self.room, self._server.metadata_spec)
        self.stamps["send_called"] = time.monotonic()
        self._server.io.call(lambda: self._server._send_room(self, kv, header, payload))

    def abort(self, reason: str = "aborted by prefill") -> None:
        self._server.io.call(lambda: self._server._abort_room(self, reason, notify=True))


class PrefillTransferServer:
    def __init__(
        self,
        config: TransferConfig,
        layout: KVLayout,
        metadata_spec: MetadataSpec,
        prefill_id: str,
        metrics: TransferMetrics | None = None,
        device: torch.device | None = None,
    ):
        """device: where `send()` buffers live (the GPU for nccl; CPU for tcp and gloo)."""
        self.config = config
        self.layout = layout
        self.metadata_spec = metadata_spec
        self.prefill_id = prefill_id
        self.metrics = metrics or TransferMetrics()
        self.context = zmq.Context()
        self.io = IOThread(f"prefill-transfer-{prefill_id}", self.context)
        self._rooms: dict[int, SenderRoom] = {}
        self._lock = threading.Lock()
        self._peers: dict[bytes, _Peer] = {}
        self._tombstones = Tombstones(config.tombstone_ttl_s)
        self.port: int | None = None
        self.dist: DistPlane | None = None
        if config.backend != "tcp":
            link_device = device or torch.device("cpu")
            self.dist = DistPlane(
                config.backend,
                "prefill",
                config.progress_timeout_s,
                link_device,
                config.bootstrap_host,
            )
        # Buffers announced with SendReady, kept until their send happened (see dist_plane).
        self._announced: dict[int, tuple[SenderRoom, torch.Tensor]] = {}

    # ---- life cycle ------------------------------------------------------------------

    def start(self) -> int:
        """Bind the bootstrap endpoint (port 0 picks a free one); return the port."""
        self._router = self.context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.SNDTIMEO, int(self.config.send_timeout_s * 1000))
        self._router.setsockopt(zmq.LINGER, 0)
        host, port = self.config.bootstrap_host, self.config.bootstrap_port
        if port == 0:
            self.port = self._router.bind_to_random_port(f"tcp://{host}")
        else:
            self._router.bind(f"tcp://{host}:{port}")
            self.port = port
        self.io.poller.register(self._router, zmq.POLLIN)
        self.io.start(self._on_socket, self._on_tick, tick_s=0.05)
        return self.port

    def stop(self) -> None:
        self.io.stop()
        if self.dist is not None:
            self.dist.close()
        self._router.close(0)
        self.context.term()

    def sender(self, room: int) -> SenderRoom:
        """The room's sender, created in BOOTSTRAPPING if decode has not asked for it yet."""
        with self._lock:
            if room not in self._rooms:
                state = RoomState(room, progress_timeout_s=self.config.progress_timeout_s)
                if room in self._tombstones:
                    reason = self._tombstones.failure_reason(room)
                    state.fail(reason or "room already finished (reused bootstrap_room)")
                self._rooms[room] = SenderRoom(self, room, state)
            return self._rooms[room]

    @property
    def pending_sends(self) -> int:
        """KV buffers announced to decode whose send has not started yet."""
        return len(self._announced)

    def release(self, room: int) -> None:
        """Forget a finished room (its tombstone stays for late messages)."""
        with self._lock:
            self._rooms.pop(room, None)

    # ---- IO thread -------------------------------------------------------------------

    def _on_socket(self, socket: zmq.Socket) -> None:
        while True:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            identity, body = frames[0], frames[1]
            peer = self._peers.setdefault(identity, _Peer())
            peer.last_seen = time.monotonic()
            try:
                msg = decode(body, _FROM_DECODE)
            except ProtocolError as e:
                self.metrics.failure("malformed_message")
                logger.warning("dropped a malformed message from a decode peer: %s", e)
                continue
            self._handle(identity, peer, msg)

    def _handle(self, identity: bytes, peer: _Peer, msg) -> None:
        if isinstance(msg, Register):
            self._register(identity, peer, msg)
        elif isinstance(msg, TransferRequest):
            self._transfer_request(identity, peer, msg)
        elif isinstance(msg, AbortRoom):
            room = self._rooms.get(msg.room)
            reason = f"decode aborted: {msg.reason}"
            if room is not None:
                self._abort_room(room, reason, notify=False)
            elif msg.room not in self._tombstones:
                # NOTE: the prefill leg may not have arrived yet; it fails when it does.
                self._tombstones.add(msg.room, reason)
        elif isinstance(msg, RoomAck):
            room = self._rooms.get(msg.room)
            if room is not None and room.peer == identity:
                self._finish(room)
        elif isinstance(msg, Heartbeat):
            self._reply(identity, Heartbeat(self.prefill_id))
        elif isinstance(msg, RecvPosted):
            self._recv_posted(identity, msg.room)

    def _register(self, identity: bytes, peer: _Peer, msg: Register) -> None:
        peer.decode_id = msg.decode_id
        if not self._token_ok(msg.token):
            peer.rejected = "authentication failed: wrong or missing transfer token"
        elif msg.backend != self.config.backend:
            peer.rejected = (
                f"transfer backend: prefill {self.config.backend!r} != decode {msg.backend!r}"
            )
        else:
            mismatches = layout_mismatches(self.layout, msg.layout)
            peer.rejected = "; ".join(mismatches) if mismatches else None
        if peer.rejected:
            self.metrics.failure("handshake")
            logger.error("rejected decode peer %s: %s", msg.decode_id, peer.rejected)
            self._reply(identity, RegisterRejected(peer.rejected))
        else:
            self._reply(identity, RegisterAck(self.prefill_id))
            if self.dist is not None:
                self.dist.connect(
                    identity,
                    msg.store_address,
                    msg.pair_name,
                    lambda error: self.io.call(lambda: self._link_ready(identity, error)),
                )

    def _transfer_request(self, identity: bytes, peer: _Peer, msg: TransferRequest) -> None:
        if msg.room in self._tombstones:
            # A room that failed before decode asked (e.g. prefill rejected the prompt) still
            # fails decode's room at once; a duplicate for a finished room is ignored.
            reason = self._tombstones.failure_reason(msg.room)
            if reason is not None:
                self._reply(identity, AbortRoom(msg.room, reason))
            return
        room = self.sender(msg.room)
        reason = None
        if not self._token_ok(msg.token):
            reason = "authentication failed: wrong or missing transfer token"
        elif peer.rejected or not peer.decode_id:
            reason = peer.rejected or "transfer request before registration"
        if reason is not None:
            self._reply(identity, AbortRoom(msg.room, reason))
            room._state.fail(f"handshake failed: {reason}")
            self._tombstones.add(msg.room, room.failure_reason)
            return
        if room.peer is not None:
            return  # duplicate
        room.peer = identity
        room.decode_page_ids = list(msg.page_ids)
        room.draft_page_ids = list(msg.draft_page_ids)
        if room._state.state is TransferState.BOOTSTRAPPING:
            room._state.advance(TransferState.WAITING_FOR_INPUT)

    def _send_room(self, room: SenderRoom, kv, header, payload: bytes) -> None:
        state = room._state
        if state.done:
            return
        if room.peer is None or state.state is not TransferState.WAITING_FOR_INPUT:
            self._abort_room(room, f"send() in state {state.state.name}", notify=True)
            return
        state.advance(TransferState.TRANSFERRING)
        if self.dist is not None:
            # NOTE: the metadata goes first, on the same ordered connection: decode then
            # commits as soon as its receive completes, one round trip sooner.
            try:
                self._router.send_multipart([room.peer, encode(header), payload])
            except zmq.ZMQError as e:
                self._abort_room(room, f"sending to decode failed: {e}", notify=False)
                return
            self._announced[room.room] = (room, kv)
            self._reply(room.peer, SendReady(room.room, kv.numel()))
            room.stamps["send_ready_sent"] = time.monotonic()
            return
        room._buffer = kv  # NOTE: frames are sent zero-copy; keep the buffer until the ack
        view = memoryview(kv.numpy())
        total = kv.numel()
        try:
            for offset in range(0, total, self.config.chunk_bytes):
                nbytes = min(self.config.chunk_bytes, total - offset)
                self._router.send_multipart(
                    [
                        room.peer,
                        encode(KVChunk(room.room, offset, nbytes)),
                        view[offset : offset + nbytes],
                    ],
                    copy=False,
                )
            self._router.send_multipart([room.peer, encode(header), payload])
            self._router.send_multipart([room.peer, encode(RoomDone(room.room, total))])
        except zmq.ZMQError as e:
            self._abort_room(room, f"sending to decode failed: {e}", notify=False)
            return
        self.metrics.bytes_sent += total

    def _recv_posted(self, identity: bytes, room_id: int) -> None:
        announced = self._announced.pop(room_id, None)
        if announced is None:
            return
        room, kv = announced
        room.stamps["recv_posted_seen"] = time.monotonic()
        # NOTE: send even if the room failed meanwhile: decode's receive is posted.
        self.dist.send(
            identity,
            kv,
            lambda error: self.io.call(lambda: self._sent(room, kv.numel(), error)),
        )

    def _sent(self, room: SenderRoom, total: int, error) -> None:
        room.stamps["send_done_seen"] = time.monotonic()
        if error is not None:
            self._abort_room(room, error, notify=True)
            return
        self.metrics.bytes_sent += total
        if not room._state.done:  # decode may have acked already (it commits on receipt)
            self._reply(room.peer, RoomDone(room.room, total))

    def _link_ready(self, identity: bytes, error: str | None) -> None:
        if error is None:
            return
        peer = self._peers.get(identity)
        if peer is not None:
            peer.rejected = error
        for room in list(self._rooms.values()):
            if room.peer == identity:
                self._abort_room(room, error, notify=True)

    def _abort_room(self, room: SenderRoom, reason: str, *, notify: bool) -> None:
        if room._state.fail(reason):
            self.metrics.failure("aborted" if "abort" in reason else "error")
            if notify and room.peer is not None:
                self._reply(room.peer, AbortRoom(room.room, reason))
        room._buffer = None
        self._tombstones.add(room.room, room.failure_reason)

    def _finish(self, room: SenderRoom) -> None:
        room.stamps["ack_seen"] = time.monotonic()
        if room._state.state is TransferState.TRANSFERRING:
            room._state.advance(TransferState.SUCCESS)
            self.metrics.succeeded(time.monotonic() - room.started_at)
        room._buffer = None
        self._tombstones.add(room.room)

    def _on_tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            rooms = list(self._rooms.values())
        for room in rooms:
            if room._state.done:
                continue
            peer = self._peers.get(room.peer) if room.peer is not None else None
            if peer is not None and now - peer.last_seen > self.config.peer_timeout_s:
                silent = now - peer.last_seen
                self._abort_room(
                    room, f"decode peer {peer.decode_id} silent for {silent:.1f} s", notify=False
                )
            elif room._state.check_deadline():
                self.metrics.failure("timeout")
                self._reply(room.peer, AbortRoom(room.room, room.failure_reason))
                room._buffer = None
                self._tombstones.add(room.room, room.failure_reason)

    def _reply(self, identity: bytes | None, msg) -> None:
        if identity is None:
            return
        try:
            self._router.send_multipart([identity, encode(msg)])
        except zmq.ZMQError as e:
            logger.warning("could not reach decode peer: %s", e)

    def _token_ok(self, token: str) -> bool:
        expected = self.config.auth_token
        return not expected or hmac.compare_digest(token.encode(), expected.encode())
