"""One room on the prefill side of a handoff (see `prefill_side`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from pdserve.transfer.metadata import MetadataRecord
from pdserve.transfer.room_state import RoomState, TransferState

if TYPE_CHECKING:
    from pdserve.transfer.prefill_side import PrefillTransferServer


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
        # Asked for by this worker's own request (not only by a decode peer's transfer request).
        self.claimed = False
        self.started_at = time.monotonic()
        # When each protocol step happened (monotonic clock), for latency breakdowns.
        self.stamps: dict[str, float] = {}

    def poll(self) -> TransferState:
        return self._state.state

    @property
    def failure_reason(self) -> str | None:
        return self._state.failure_reason

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
        self._server.io.call(lambda: self._server._send_room(self, kv, header, payload))

    def abort(self, reason: str = "aborted by prefill") -> None:
        self._server.io.call(lambda: self._server._abort_room(self, reason, notify=True))
