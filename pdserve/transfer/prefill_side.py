"""The prefill side of the handoff: the bootstrap endpoint and one sender per room.

A decode worker connects (DEALER) to our bootstrap ROUTER, proves it holds the transfer token
(`Hello` / `HelloReply` / `Register`, see prefill_peers), registers its layout once, then sends
a `TransferRequest` per room once it reserved pages. The prefill worker asks `sender(room)`,
computes only after the room reached WAITING_FOR_INPUT (decode's pages exist), sends the KV in
pieces as prefill writes it (`send_piece`, see kv_piece), then the metadata record (`finish`);
the room succeeds when decode acks it.

Nothing a connection sends before it registered creates state beyond its (bounded) peer
entry: anything but `Hello` is answered `NotRegistered`. Peers that fail, stall or fall silent
are dropped with their rooms (see endpoint); every send is non-blocking (see outbox).
"""

from __future__ import annotations

import logging
import secrets

import torch
import zmq

from pdserve.protocol.channel import Channel
from pdserve.protocol.codec import ProtocolError
from pdserve.protocol.failures import Failure, FailureKind
from pdserve.protocol.metadata_spec import MetadataSpec
from pdserve.protocol.transfer_messages import (
    AbortRoom,
    Heartbeat,
    Hello,
    KVLayout,
    Register,
    RoomAck,
    RoomDone,
    TransferRequest,
)
from pdserve.transfer.bootstrap_connections import ConnectionLimit
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.endpoint import Endpoint
from pdserve.transfer.kv_piece import OutgoingPiece, PageSpan
from pdserve.transfer.metadata import MetadataRecord
from pdserve.transfer.metrics import TransferMetrics
from pdserve.transfer.peer import Peer
from pdserve.transfer.prefill_peers import DecodePeer, DecodePeers
from pdserve.transfer.prefill_rooms import PrefillRooms
from pdserve.transfer.room_state import TransferState, room_failure
from pdserve.transfer.sender_room import SenderRoom
from pdserve.transfer.staged_sends import StagedSends

_FROM_DECODE = (Hello, Register, TransferRequest, AbortRoom, RoomAck, Heartbeat)
# Pages of one room when the caller does not say (a 1M-token prompt in 16-token pages).
DEFAULT_MAX_ROOM_PAGES = 1 << 16

__all__ = ["PrefillTransferServer", "Sender"]

logger = logging.getLogger(__name__)


class PrefillTransferServer(PrefillRooms, DecodePeers, Endpoint):
    side, peer_side = "prefill", "decode"

    def __init__(
        self,
        config: TransferConfig,
        layout: KVLayout,
        metadata_spec: MetadataSpec,
        prefill_id: str,
        metrics: TransferMetrics | None = None,
        device: torch.device | None = None,
        max_room_pages: int = DEFAULT_MAX_ROOM_PAGES,
        source_device: torch.device | None = None,
        tp_size: int = 1,
        ranks_host: str = "127.0.0.1",
        pools: list[torch.Tensor] | None = None,
    ):
        """device: where KV pieces live when sent (the GPU for nccl; CPU for tcp and gloo).
        max_room_pages: the most pages one room can need (bounds a transfer request).
        source_device: where the KV is computed; a GPU's pieces sent from the CPU are copied
        without blocking, and sent once their `ready` event completed.
        tp_size: this worker's tensor-parallel size; over torch.distributed each rank sends
        its own KV heads (`head_slices`, `rank_fanout`), reporting to rank 0 at `ranks_host`
        (loopback unless the worker's ranks span nodes).
        pools: the `ipc` backend: this worker's pools' storage tensors (target, then draft),
        which a decode worker's must match."""
        super().__init__(config, prefill_id, metrics)
        self.layout = layout
        self.metadata_spec = metadata_spec
        self.prefill_id = prefill_id
        # NOTE: new per process, so a decode worker sees a restart on the same address.
        self.instance = secrets.randbits(63)
        self.max_room_pages = max_room_pages
        self.port: int | None = None
        self.connections: ConnectionLimit | None = None  # once started
        self.tp_size = tp_size
        self.start_fanout(tp_size, ranks_host)
        # Rooms a decode peer asked for whose prefill request has not arrived, and that peer
        # (under the lock; bounded, see `_waiting_limit`).
        self.waiting_rooms: dict[int, DecodePeer] = {}
        on_gpu = source_device is not None and source_device.type == "cuda"
        device = device or torch.device("cpu")
        self.plane = self.backend.send_plane(self, device, self.fanout, pools)
        staged = on_gpu and self.backend.stages_gpu_pieces(device)
        poll_s = self.backend.stage_poll_s
        self._staged = StagedSends(self.io, config.progress_timeout_s, poll_s) if staged else None

    # ---- life cycle ------------------------------------------------------------------

    def start(self) -> int:
        """Bind the bootstrap endpoint (port 0 picks a free one); return the port."""
        self.channel = Channel(
            self.context,
            zmq.ROUTER,
            _FROM_DECODE,
            max_message_bytes=self.backend.max_decode_message_bytes(self.max_room_pages),
        )
        self.connections = ConnectionLimit(
            self.context,
            self.channel.socket,
            self.config.max_bootstrap_connections,
            self.config.max_bootstrap_connections_per_host,
            self.config.peer_timeout_s,
            self.peer_log,
        )
        host, port = self.config.bootstrap_host, self.config.bootstrap_port
        if port == 0:
            self.port = self.channel.bind_random_port(f"tcp://{host}")
        else:
            self.channel.bind(f"tcp://{host}:{port}")
            self.port = port
        self.io.poller.register(self.channel.socket, zmq.POLLIN)
        for socket in self.connections.sockets:
            self.io.poller.register(socket, zmq.POLLIN)
        self.io.start(self._on_socket, self.tick, tick_s=0.05)
        if not self.config.auth_token:
            logger.warning(
                "prefill %s has no transfer token: any host that reaches its bootstrap port "
                "%s:%d can register as a decode worker; give every prefill and decode worker "
                "the same --transfer-token (or $PDSERVE_TRANSFER_TOKEN)",
                self.prefill_id,
                host,
                self.port,
            )
        return self.port

    def stop(self) -> None:
        if self._staged is not None:
            self._staged.stop()
        self.io.stop()
        self.plane.close()
        if self.connections is not None:
            self.connections.close()
        self.channel.close()
        self.context.term()
        self.doorbell.close()

    def sender(self, room: int) -> Sender:
        """The room's sender, created in BOOTSTRAPPING if decode has not asked for it yet."""
        with self.lock:
            sender = self._room(room).claim()
            self._stop_waiting(room)
            return Sender(self, sender)

    @property
    def pending_sends(self) -> int:
        """KV pieces posted to decode whose send has not completed (torch.distributed)."""
        return self.plane.pending_sends

    # ---- IO thread -------------------------------------------------------------------

    def _socket_of(self, peer: Peer) -> zmq.Socket:
        return self.channel.socket

    def _frames(self, peer: Peer, msg, payload: tuple) -> list:
        return self.channel.frames(msg, *payload, to=peer.key)

    def _on_socket(self, socket: zmq.Socket) -> None:
        if self.on_fanout(socket) or self.connections.on_socket(socket):
            return
        while True:
            try:
                # NOTE: copy=False for the sender's address (a bound on peers per host).
                received = self.channel.receive(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except ProtocolError as e:
                self.malformed(None, str(e))
                continue
            self._on_message(received.sender, received.msg, received.address or "")

    def _handle(self, peer: Peer, msg) -> None:
        """A message from a registered peer."""
        if isinstance(msg, TransferRequest):
            self._transfer_request(peer, msg)
        elif isinstance(msg, AbortRoom):
            self._abort_from_peer(peer, msg)
        elif isinstance(msg, RoomAck):
            room = self.room_of(peer, msg.room)
            if room is not None and room.acked():
                self.metrics.succeeded(room.stamps["ack_seen"] - room.started_at)
            if room is not None:
                self.end_room(room)
        elif isinstance(msg, Heartbeat):
            self.send(peer, Heartbeat(self.prefill_id))
        else:
            self.plane.handle(peer, msg, None)

    def send(self, peer: Peer, msg, *payload, copy: bool = True) -> bool:
        """`Endpoint.send`, but for what the plane carries itself (`ipc`: a decode peer's
        announcement lane, from whichever thread announces)."""
        carried = self.plane.carry(peer, msg, payload)
        if carried is not None:
            return carried
        return super().send(peer, msg, *payload, copy=copy)

    def end_room(self, room, *, notify: bool = False) -> None:
        super().end_room(room, notify=notify)
        self.plane.room_ended(room)

    def fail_on_io_thread(self, room, failure: Failure) -> None:
        """Fail a room that has not ended, from any thread: on the IO thread, which owns the
        connection (now, if that is the caller's)."""
        if room.done:
            return
        if self.io.is_current:
            self.fail_room(room, failure, notify=True)
        else:
            self.io.call(lambda: self.fail_room(room, failure, notify=True))

    def submit(self, room: SenderRoom, command, ready: torch.cuda.Event | None) -> None:
        """Run a room's send step on the IO thread, in order; with GPU pieces staged in host
        memory, each after its copy completed (`ready`), or the room fails."""
        if self._staged is None:
            self.io.call(command)
            return
        message = (
            f"the KV copy from the GPU did not complete in {self.config.progress_timeout_s:g} s"
        )
        failure = room_failure(message, FailureKind.INTERNAL)
        self._staged.submit(command, ready, lambda: self.fail_room(room, failure, notify=True))

    def send_piece(self, room: SenderRoom, piece: OutgoingPiece) -> None:
        index = room_failure("the room ended") if room.done else room.begin_piece()
        if isinstance(index, Failure):
            self.fail_on_io_thread(room, index)
            if piece.remote and room.peer is not None:
                # NOTE: the other ranks posted their parts already: decode must post the
                # matching receives (into scratch), or each link's order breaks.
                self.plane.send_piece(room, piece, room.skip_piece())
            return
        if piece.span is None:
            piece.span = room.whole()
        if self.plane.send_piece(room, piece, index):
            self.metrics.pieces_sent += 1
            room.sent(piece.nbytes)

    def finish_room(self, room: SenderRoom, header, payload: bytes) -> None:
        """After the last piece: the metadata record, then `RoomDone`."""
        if room.done:
            return
        if room.pieces_sent == 0:
            self.fail_on_io_thread(room, room_failure("finished without any KV"))
            return
        room.stamp("finished")
        if self.send(room.peer, header, payload):
            self.send(room.peer, RoomDone(room.room, room.bytes_sent, room.pieces_sent))


class Sender:
    """The prefill worker's hold on one room (`PrefillTransferServer.sender`): what its thread
    calls to send the room's KV, each step handed to the server, which alone changes the room
    (`SenderRoom`). The room's state and failure read from any thread."""

    def __init__(self, server: PrefillTransferServer, room: SenderRoom):
        self.server = server
        self.state = room

    @property
    def room(self) -> int:
        return self.state.room

    def poll(self) -> TransferState:
        return self.state.poll()

    @property
    def done(self) -> bool:
        return self.state.done

    @property
    def failure(self) -> Failure | None:
        return self.state.failure

    @property
    def num_cached_pages(self) -> int:
        """The room's first pages, which decode holds already (never sent)."""
        return self.state.num_cached_pages

    @property
    def peer(self) -> Peer | None:
        return self.state.peer

    @property
    def stamps(self) -> dict[str, float]:
        return self.state.stamps

    def started(self) -> None:
        """The prefill began computing this room: the progress deadline counts from now (the
        wait in the prefill queue before it had its own, longer, deadline)."""
        self.server.io.call(self.state.restart_clock)

    def destination(self, span: PageSpan) -> tuple[list[torch.Tensor], list[list[int]]] | None:
        """Where to write a piece's pages (`ipc`): decode's pools mapped here, and its page
        ids, one list per pool; None if the room takes no more writes (it ended). Each write
        given a destination must be handed to `send_piece` once queued."""
        return self.server.plane.open_write(self.state, span)

    def write_failed(self, message: str) -> None:
        """A write given a `destination` could not be queued (nothing of it runs)."""
        room, failure = self.state, room_failure(message, FailureKind.INTERNAL)
        server = self.server
        server.io.call(lambda: server.plane.write_failed(room, failure))

    def send_piece(self, piece: OutgoingPiece, then: MetadataRecord | None = None) -> None:
        """Send one piece of the room's KV (flat uint8 from `KVStager.gather`: on the CPU for
        tcp and gloo, on the GPU for nccl; with `ipc`, written into decode's pages already,
        see `destination`). Pieces go out in the order given. `then`: the room's last piece,
        and what `finish` is then called with (with `ipc`, announced with the piece)."""
        server, room = self.server, self.state
        if piece.targets:
            room.stamp("first_piece_called", first=True)
            steps = [lambda: server.send_piece(room, piece)]
            if then is not None:
                steps.append(self._finish_step(then))
            server.plane.written_piece(room, piece, steps)
            return
        wanted = server.backend.piece_device_type()
        buffers = [piece.data] if piece.data is not None else [data for _, data in piece.sends]
        for data in buffers:
            if data.dtype != torch.uint8 or data.device.type != wanted or not data.is_contiguous():
                raise ValueError(
                    f"a KV piece must be contiguous uint8 buffers on {wanted} (see KVStager.gather)"
                )
        room.stamp("first_piece_called", first=True)
        server.submit(room, lambda: server.send_piece(room, piece), piece.ready)
        if then is not None:
            self.finish(then)

    def finish(self, metadata: MetadataRecord) -> None:
        """Every piece was given: send the metadata record and end the room's sending."""
        finish = self._finish_step(metadata)
        if not self.server.plane.announce_step(self.state, finish):  # NOTE: in their order
            self.server.submit(self.state, finish, None)

    def _finish_step(self, metadata: MetadataRecord):
        server, room = self.server, self.state
        header, payload = metadata.pack(room.room, server.metadata_spec)
        room.stamp("finish_called")
        return lambda: server.finish_room(room, header, payload)

    def send(self, kv: torch.Tensor, metadata: MetadataRecord) -> None:
        """Send the room's KV whole (every page decode reserved, as one piece) and finish."""
        self.send_piece(OutgoingPiece(None, kv))
        self.finish(metadata)

    def abort(self, kind: FailureKind, message: str) -> None:
        server, room, failure = self.server, self.state, room_failure(message, kind)
        server.io.call(lambda: server.fail_room(room, failure, notify=True))
