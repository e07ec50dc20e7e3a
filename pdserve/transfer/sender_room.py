"""One room on the prefill side of a handoff (see `prefill_side`): its state, the peer that
asked for it, the pages it asked for, and the KV pieces kept alive while they are sent. The
prefill worker's thread calls `started`, `send_piece`, `finish`, `send` and `abort`;
everything else runs on the IO thread. State reads are safe from any thread."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from pdserve.protocol.failures import FailureKind
from pdserve.transfer.kv_piece import OutgoingPiece, PageSpan
from pdserve.transfer.metadata import MetadataRecord
from pdserve.transfer.room_state import Room, RoomState, TransferState

if TYPE_CHECKING:
    from pdserve.transfer.endpoint import Peer
    from pdserve.transfer.prefill_side import PrefillTransferServer


class SenderRoom(Room):
    def __init__(self, server: PrefillTransferServer, room: int, state: RoomState):
        super().__init__(room, state)
        self._server = server
        self.peer: Peer | None = None
        # The pages decode reserved (from its transfer request): what the pieces must cover,
        # but the first `num_cached_pages`, which decode holds already.
        self.num_pages = 0
        self.num_draft_pages = 0
        self.num_cached_pages = 0
        # The `ipc` backend: decode's page ids (what the pieces are written into), the writes
        # queued and not completed, and whether the room takes more (guarded by the lock).
        self.decode_pages: list[int] = []
        self.decode_draft_pages: list[int] = []
        self.writes_in_flight = 0
        self.writes_closed = False
        self._buffers: list[torch.Tensor] = []
        self.pieces_sent = 0
        self.bytes_sent = 0
        # Asked for by this worker's own request (not only by a decode peer's transfer request).
        self.claimed = False
        self.started_at = time.monotonic()
        # When each protocol step happened (monotonic clock), for latency breakdowns.
        self.stamps: dict[str, float] = {}

    # ---- the prefill worker's thread -------------------------------------------------

    def claim(self) -> SenderRoom:
        self.claimed = True
        return self

    def started(self) -> None:
        """The prefill began computing this room: the progress deadline counts from now (the
        wait in the prefill queue before it had its own, longer, deadline)."""
        self._server.io.call(self._state.restart_clock)

    def destination(self, span: PageSpan) -> tuple[list[torch.Tensor], list[list[int]]] | None:
        """Where to write a piece's pages (`ipc`): decode's pools mapped here, and its page
        ids, one list per pool; None if the room takes no more writes (it ended). Each write
        given a destination must be handed to `send_piece` once queued."""
        return self._server.open_write(self, span)

    def write_failed(self, message: str) -> None:
        """A write given a `destination` could not be queued (nothing of it runs)."""
        self._server.io.call(lambda: self._server.write_failed(self, message))

    def send_piece(self, piece: OutgoingPiece, then: MetadataRecord | None = None) -> None:
        """Send one piece of the room's KV (flat uint8 from `KVStager.gather`: on the CPU for
        tcp and gloo, on the GPU for nccl; with `ipc`, written into decode's pages already,
        see `destination`). Pieces go out in the order given. `then`: the room's last piece,
        and what `finish` is then called with (with `ipc`, announced with the piece)."""
        if piece.targets:
            # NOTE: announced at once: decode's work on the pages waits for the write's event
            # on the GPU. The write counts as in flight until that event is seen complete.
            self.stamps.setdefault("first_piece_called", time.monotonic())
            steps = [lambda: self._server.send_piece(self, piece)]
            if then is not None:
                steps.append(self._finish_step(then))
            self._server.announce(self, *steps)
            self._server.submit(self, lambda: self._server.written(self, piece), piece.ready)
            return
        wanted = self._server.backend.piece_device_type()
        buffers = [piece.data] if piece.data is not None else [data for _, data in piece.sends]
        for data in buffers:
            if data.dtype != torch.uint8 or data.device.type != wanted or not data.is_contiguous():
                raise ValueError(
                    f"a KV piece must be contiguous uint8 buffers on {wanted} (see KVStager.gather)"
                )
        self.stamps.setdefault("first_piece_called", time.monotonic())
        self._server.submit(self, lambda: self._server.send_piece(self, piece), piece.ready)
        if then is not None:
            self.finish(then)

    def finish(self, metadata: MetadataRecord) -> None:
        """Every piece was given: send the metadata record and end the room's sending."""
        finish = self._finish_step(metadata)
        if self._server.backend.writes_decode_pages:
            self._server.announce(self, finish)  # NOTE: after the announcements, not the writes
        else:
            self._server.submit(self, finish, None)

    def _finish_step(self, metadata: MetadataRecord):
        header, payload = metadata.pack(self.room, self._server.metadata_spec)
        self.stamps["finish_called"] = time.monotonic()
        return lambda: self._server.finish_room(self, header, payload)

    def send(self, kv: torch.Tensor, metadata: MetadataRecord) -> None:
        """Send the room's KV whole (every page decode reserved, as one piece) and finish."""
        self.send_piece(OutgoingPiece(None, kv))
        self.finish(metadata)

    def abort(self, kind: FailureKind, message: str) -> None:
        self._server.io.call(lambda: self._server.fail_room(self, kind, message, notify=True))

    # ---- IO thread -------------------------------------------------------------------

    def attach(self, peer: Peer) -> None:
        """Decode reserved pages for this room: wait for the prefill queue (not a stall:
        `started()` restarts the progress deadline when compute begins)."""
        self.peer = peer
        if self._state.state is TransferState.BOOTSTRAPPING:
            self._state.advance(TransferState.WAITING_FOR_INPUT)
            self._state.hold(self._server.config.queue_timeout_s)

    def whole(self) -> PageSpan:
        """Every page decode reserved and does not hold already."""
        first = self.num_cached_pages
        return PageSpan(first, self.num_pages - first, 0, self.num_draft_pages)

    def begin_piece(self) -> int | str:
        """The next piece's index (the room is TRANSFERRING from its first); why not, if it
        cannot send one. (On the worker's thread when announced over `ipc_lane`.)"""
        state = self._state.state
        if self.peer is None or state not in (
            TransferState.WAITING_FOR_INPUT,
            TransferState.TRANSFERRING,
        ):
            return f"a KV piece in state {state.name}"
        if state is TransferState.WAITING_FOR_INPUT:
            if not self._state.advance(TransferState.TRANSFERRING):
                return "a KV piece for a room that failed"  # NOTE: meanwhile, on the IO thread
        else:
            self._state.restart_clock()
        self.pieces_sent += 1
        return self.pieces_sent - 1

    def keep(self, kv: torch.Tensor) -> None:
        """Keep `kv` alive until the room ends (frames sent zero-copy are views of it)."""
        self._buffers.append(kv)

    def acked(self) -> bool:
        """Decode has the room whole; False if it had ended otherwise."""
        self.stamps["ack_seen"] = time.monotonic()
        if self._state.state is not TransferState.TRANSFERRING:
            return False
        return self._state.advance(TransferState.SUCCESS)

    def drop_buffer(self) -> None:
        self._buffers = []
