"""One room on the prefill side of a handoff (see `prefill_side`): its state, the peer that
asked for it, and the KV buffer kept alive while it is sent. The prefill worker's thread calls
`started`, `send` and `abort`; everything else runs on the IO thread. State reads are safe
from any thread."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from pdserve.protocol.failures import FailureKind
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
        self._buffer: torch.Tensor | None = None
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
        self._server.io.call(lambda: self._server.send_room(self, kv, header, payload))

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

    def begin_send(self) -> str | None:
        """Move to TRANSFERRING; why not, if it cannot."""
        if self.peer is None or self._state.state is not TransferState.WAITING_FOR_INPUT:
            return f"send() in state {self._state.state.name}"
        self._state.advance(TransferState.TRANSFERRING)
        return None

    def keep(self, kv: torch.Tensor) -> None:
        """Keep `kv` alive until the room ends (frames sent zero-copy are views of it)."""
        self._buffer = kv

    def acked(self) -> bool:
        """Decode has the room whole; False if it had ended otherwise."""
        self.stamps["ack_seen"] = time.monotonic()
        if self._state.state is not TransferState.TRANSFERRING:
            return False
        return self._state.advance(TransferState.SUCCESS)

    def drop_buffer(self) -> None:
        self._buffer = None
