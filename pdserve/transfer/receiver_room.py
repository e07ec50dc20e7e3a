"""One room on the decode side of a handoff: its state, its receive buffer, and the commit
that writes the received KV into the room's pages (see `decode_side`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from pdserve.protocol.transfer_messages import RoomDone
from pdserve.transfer.kv_staging import KVStager
from pdserve.transfer.metadata import MetadataRecord
from pdserve.transfer.room_state import RoomState, TransferState

if TYPE_CHECKING:
    from pdserve.transfer.decode_side import DecodeTransferClient, _Peer


class ReceiverRoom:
    """One room on the decode side. State reads are safe from any thread."""

    def __init__(
        self,
        client: DecodeTransferClient,
        room: int,
        peer: _Peer | None,
        page_ids: list[int],
        draft_page_ids: list[int],
        expected_bytes: int,
    ):
        self._client = client
        self.room = room
        self._peer = peer
        self.page_ids = page_ids
        self.draft_page_ids = draft_page_ids
        self.expected_bytes = expected_bytes
        self._state = RoomState(room, progress_timeout_s=client.config.progress_timeout_s)
        # NOTE: until the first byte, the room waits for the prefill worker's queue too.
        self._state.hold(client.config.queue_timeout_s)
        self._buffer: torch.Tensor | None = None
        self._received = 0
        self.metadata: MetadataRecord | None = None
        self.started_at = time.monotonic()
        # When each protocol step happened (monotonic clock), for latency breakdowns.
        self.stamps: dict[str, float] = {}
        self._recv_in_flight = False
        self._deferred_done: RoomDone | None = None
        # The prefill instance our transfer request went to (None: not sent yet), and whether
        # it was sent again after that prefill worker asked us to register first.
        self._instance: int | None = None
        self._retried = False

    def poll(self) -> TransferState:
        return self._state.state

    @property
    def failure_reason(self) -> str | None:
        return self._state.failure_reason

    def abort(self, reason: str = "aborted by decode") -> None:
        """Fail the room and tell prefill. The pages may be freed right after this returns."""
        self._state.fail(reason)
        self._client.io.call(lambda: self._client._send_abort(self, reason))

    def commit(self, stager: KVStager) -> MetadataRecord:
        """Write the received KV into this room's pages; call once, after SUCCESS."""
        if self._state.state is not TransferState.SUCCESS or self._buffer is None:
            raise RuntimeError(f"room {self.room} cannot commit in {self._state.state.name}")
        pages = [self.page_ids, self.draft_page_ids][: len(stager.pools)]
        stager.scatter(pages, self._buffer)
        self._client.buffers.give(self._buffer)
        self._buffer = None
        return self.metadata
