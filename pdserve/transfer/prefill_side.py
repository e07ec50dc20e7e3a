"""The prefill side of the handoff: the bootstrap endpoint and one sender per room.

A decode worker connects (DEALER) to our bootstrap ROUTER, proves it holds the transfer token
(`Hello` / `HelloReply` / `Register`, see peer_auth), registers its layout once, then sends a
`TransferRequest` per room once it reserved pages. The prefill worker asks `sender(room)`,
computes only after the room reached WAITING_FOR_INPUT (decode's pages exist), then `send()`s
the KV buffer and the metadata record; the room succeeds when decode acks it.

Nothing a connection sends before it registered creates state beyond its (bounded) peer
entry: anything but `Hello` is answered `NotRegistered`. Peers that fail, stall or fall silent
are dropped with their rooms; every send is non-blocking (see outbox).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

import torch
import zmq

from pdserve.protocol.codec import ProtocolError, decode, encode
from pdserve.protocol.log_limit import RateLimitedLog
from pdserve.protocol.metadata_spec import MetadataSpec
from pdserve.protocol.transfer_messages import (
    AbortRoom,
    Heartbeat,
    Hello,
    KVChunk,
    KVLayout,
    RecvPosted,
    Register,
    RoomAck,
    RoomDone,
    SendReady,
    TransferRequest,
)
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.dist_plane import DistPlane
from pdserve.transfer.io_thread import IOThread
from pdserve.transfer.metrics import TransferMetrics
from pdserve.transfer.prefill_peers import PeerRegistry, _Peer
from pdserve.transfer.room_state import RoomState, Tombstones, TransferState
from pdserve.transfer.sender_room import SenderRoom
from pdserve.transfer.wire_limits import max_decode_message_bytes

logger = logging.getLogger(__name__)

_FROM_DECODE = (Hello, Register, TransferRequest, AbortRoom, RoomAck, Heartbeat, RecvPosted)
# Pages of one room when the caller does not say (a 1M-token prompt in 16-token pages).
DEFAULT_MAX_ROOM_PAGES = 1 << 16

__all__ = ["PrefillTransferServer", "SenderRoom"]


class PrefillTransferServer(PeerRegistry):
    def __init__(
        self,
        config: TransferConfig,
        layout: KVLayout,
        metadata_spec: MetadataSpec,
        prefill_id: str,
        metrics: TransferMetrics | None = None,
        device: torch.device | None = None,
        max_room_pages: int = DEFAULT_MAX_ROOM_PAGES,
    ):
        """device: where `send()` buffers live (the GPU for nccl; CPU for tcp and gloo).
        max_room_pages: the most pages one room can need (bounds a transfer request)."""
        self.config = config
        self.layout = layout
        self.metadata_spec = metadata_spec
        self.prefill_id = prefill_id
        # NOTE: new per process, so a decode worker sees a restart on the same address.
        self.instance = secrets.randbits(63)
        self.max_room_pages = max_room_pages
        self.metrics = metrics or TransferMetrics()
        self.context = zmq.Context()
        self.io = IOThread(f"prefill-transfer-{prefill_id}", self.context)
        self._rooms: dict[int, SenderRoom] = {}
        self._lock = threading.Lock()
        self._peers: dict[bytes, _Peer] = {}
        self._tombstones = Tombstones(config.tombstone_ttl_s)
        self._bad_messages = RateLimitedLog(logger)
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
        # Buffers announced with SendReady, kept until their send happened (see dist_plane):
        # room -> (room, buffer, when announced).
        self._announced: dict[int, tuple[SenderRoom, torch.Tensor, float]] = {}

    # ---- life cycle ------------------------------------------------------------------

    def start(self) -> int:
        """Bind the bootstrap endpoint (port 0 picks a free one); return the port."""
        self._router = self.context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_decode_message_bytes(self.max_room_pages))
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
        sender = self._room(room)
        sender.claimed = True
        return sender

    @property
    def pending_sends(self) -> int:
        """KV buffers announced to decode whose send has not started yet."""
        return len(self._announced)

    def release(self, room: int) -> None:
        """Forget a finished room (its tombstone stays for late messages)."""
        with self._lock:
            self._rooms.pop(room, None)

    def _room(self, room: int) -> SenderRoom:
        with self._lock:
            if room not in self._rooms:
                state = RoomState(room, progress_timeout_s=self.config.progress_timeout_s)
                if room in self._tombstones:
                    reason = self._tombstones.failure_reason(room)
                    state.fail(reason or "room already finished (reused bootstrap_room)")
                self._rooms[room] = SenderRoom(self, room, state)
            return self._rooms[room]

    # ---- IO thread: receiving --------------------------------------------------------

    def _on_socket(self, socket: zmq.Socket) -> None:
        while True:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._malformed(f"a message of {len(frames) - 1} frames (expected 1)")
                continue
            identity, body = frames
            try:
                msg = decode(body, _FROM_DECODE)
            except ProtocolError as e:
                self._malformed(str(e))
                continue
            peer = self._peers.get(identity)
            if isinstance(msg, Hello):
                self._hello(identity, msg)
            elif peer is None:
                self._not_registered(identity, getattr(msg, "room", -1))
            elif isinstance(msg, Register):
                peer.last_seen = time.monotonic()
                self._register(identity, peer, msg)
            elif peer.rejected is not None and isinstance(msg, TransferRequest):
                self._refuse_room(identity, msg.room, f"handshake failed: {peer.rejected}")
            elif not peer.registered:
                self._not_registered(identity, getattr(msg, "room", -1))
            else:
                peer.last_seen = time.monotonic()
                self._handle(identity, msg)

    def _reply(self, identity: bytes | None, msg) -> bool:
        return identity is not None and self._send_to(identity, [encode(msg)])

    def _malformed(self, problem: str) -> None:
        self.metrics.failure("malformed_message")
        self._bad_messages.warning("dropped a malformed message from a decode peer: %s", problem)

    def _handle(self, identity: bytes, msg) -> None:
        if isinstance(msg, TransferRequest):
            self._transfer_request(identity, msg)
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

    def _refuse_room(self, identity: bytes, room_id: int, reason: str) -> None:
        room = self._room(room_id)
        if room._state.fail(reason):
            self._tombstones.add(room_id, reason)
        self._reply(identity, AbortRoom(room_id, reason))

    def _transfer_request(self, identity: bytes, msg: TransferRequest) -> None:
        if msg.room in self._tombstones:
            # A room that failed before decode asked (e.g. prefill rejected the prompt) still
            # fails decode's room at once; a duplicate for a finished room is ignored.
            reason = self._tombstones.failure_reason(msg.room)
            if reason is not None:
                self._reply(identity, AbortRoom(msg.room, reason))
            return
        # NOTE: checked before any room exists for it. Only a prompt longer than this worker's
        # max_model_len needs more pages: the request is at fault ("rejected", a 400), as when
        # the prefill leg's rejection reaches the room first.
        longest = max(len(msg.page_ids), len(msg.draft_page_ids))
        if longest > self.max_room_pages:
            reason = (
                f"prefill rejected the request: transfer request for {longest} pages exceeds "
                f"{self.max_room_pages}, what a prompt within its max_model_len needs"
            )
            self._refuse_room(identity, msg.room, reason)
            return
        room = self._room(msg.room)
        if room.peer is not None or room._state.done:
            return  # duplicate, or a room that already ended here
        room.peer = identity
        room.decode_page_ids = list(msg.page_ids)
        room.draft_page_ids = list(msg.draft_page_ids)
        if room._state.state is TransferState.BOOTSTRAPPING:
            room._state.advance(TransferState.WAITING_FOR_INPUT)
            # NOTE: waiting for the prefill queue is not a stall: `started()` restarts the
            # progress deadline when compute begins.
            room._state.hold(self.config.queue_timeout_s)

    # ---- IO thread: sending ----------------------------------------------------------

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
            if self._send_to(room.peer, [encode(header), payload]):
                self._announced[room.room] = (room, kv, time.monotonic())
                self._reply(room.peer, SendReady(room.room, kv.numel()))
                room.stamps["send_ready_sent"] = time.monotonic()
            return
        room._buffer = kv  # NOTE: frames are sent zero-copy; keep the buffer until the ack
        view = memoryview(kv.numpy())
        total = kv.numel()
        for offset in range(0, total, self.config.chunk_bytes):
            nbytes = min(self.config.chunk_bytes, total - offset)
            chunk = [encode(KVChunk(room.room, offset, nbytes)), view[offset : offset + nbytes]]
            if not self._send_to(room.peer, chunk, copy=False) or room._state.done:
                return
        if self._send_to(room.peer, [encode(header), payload]) and self._reply(
            room.peer, RoomDone(room.room, total)
        ):
            self.metrics.bytes_sent += total

    def _recv_posted(self, identity: bytes, room_id: int) -> None:
        announced = self._announced.pop(room_id, None)
        if announced is None:
            return
        room, kv, _ = announced
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

    # ---- endings ---------------------------------------------------------------------

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
        self._check_peers(now)
        with self._lock:
            rooms = list(self._rooms.values())
        for room in rooms:
            if room._state.done:
                if not room.claimed:
                    self.release(room.room)  # only a decode peer asked for it: nobody will
                continue
            if room._state.check_deadline():
                self.metrics.failure("timeout")
                self._reply(room.peer, AbortRoom(room.room, room.failure_reason))
                room._buffer = None
                self._tombstones.add(room.room, room.failure_reason)
        for room, _, announced_at in list(self._announced.values()):
            if now - announced_at > self.config.progress_timeout_s and room.peer is not None:
                # NOTE: the pair's order depends on this buffer: drop the whole link.
                self._drop_peer(room.peer, "decode did not post its receive in time")
