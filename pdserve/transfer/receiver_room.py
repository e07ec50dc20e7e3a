"""One room on the decode side of a handoff (see `decode_side`): its state, its receive
buffer, and the commit that writes the received KV into the room's pages. The decode worker's
thread calls `abort` and `commit`; everything else runs on the IO thread (or is handed to it
by the data plane). State reads are safe from any thread."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from pdserve.protocol.failures import FailureKind
from pdserve.transfer.buffer_pool import BufferPool
from pdserve.transfer.kv_staging import KVStager
from pdserve.transfer.metadata import MetadataRecord
from pdserve.transfer.room_state import Room, RoomState, TransferState

if TYPE_CHECKING:
    from pdserve.transfer.decode_side import DecodeTransferClient
    from pdserve.transfer.endpoint import Peer


class ReceiverRoom(Room):
    def __init__(
        self,
        client: DecodeTransferClient,
        room: int,
        page_ids: list[int],
        draft_page_ids: list[int],
        expected_bytes: int,
    ):
        super().__init__(room, RoomState(room, progress_timeout_s=client.config.progress_timeout_s))
        self._client = client
        self._buffers: BufferPool = client.buffers
        self.peer: Peer | None = None
        self.page_ids = page_ids
        self.draft_page_ids = draft_page_ids
        self.expected_bytes = expected_bytes
        # NOTE: until the first byte, the room waits for the prefill worker's queue too.
        self._state.hold(client.config.queue_timeout_s)
        self._buffer: torch.Tensor | None = None
        self._received = 0
        self.metadata: MetadataRecord | None = None
        self.started_at = time.monotonic()
        # When each protocol step happened (monotonic clock), for latency breakdowns.
        self.stamps: dict[str, float] = {}
        self._receiving = False  # a posted receive (torch.distributed) may write the buffer
        self._done_total: int | None = None  # RoomDone seen while the receive was in flight
        # The prefill instance our transfer request went to (None: not sent yet), and whether
        # it was sent again after that prefill worker asked us to register first.
        self.instance: int | None = None
        self.retried = False

    # ---- the decode worker's thread --------------------------------------------------

    def abort(self, kind: FailureKind, message: str) -> None:
        """Fail the room and tell prefill. The pages may be freed right after this returns."""
        self._state.fail(kind, message)
        self._client.io.call(lambda: self._client.end_room(self, notify=True))

    def commit(self, stager: KVStager) -> MetadataRecord:
        """Write the received KV into this room's pages; call once, after SUCCESS."""
        if self._state.state is not TransferState.SUCCESS or self._buffer is None:
            raise RuntimeError(f"room {self.room} cannot commit in {self._state.state.name}")
        pages = [self.page_ids, self.draft_page_ids][: len(stager.pools)]
        stager.scatter(pages, self._buffer)
        self._buffers.give(self._buffer)
        self._buffer = None
        return self.metadata

    # ---- IO thread -------------------------------------------------------------------

    def attach(self, peer: Peer) -> None:
        self.peer = peer

    def sent_to(self, instance: int | None) -> None:
        """Our transfer request went to this prefill instance (None: to be sent again)."""
        self.instance = instance

    def retry(self) -> bool:
        """The request may be sent once more (the prefill worker had forgotten us)."""
        if self.retried:
            return False
        self.retried, self.instance = True, None
        return True

    def on_chunk(self, offset: int, nbytes: int, data: memoryview | None) -> str | None:
        """Copy a KV chunk (tcp) into the buffer; what is wrong with it, if anything.
        NOTE: every bound is checked against our own reservation before a byte is copied."""
        size = len(data) if data is not None else -1
        if offset != self._received or size != nbytes or offset + nbytes > self.expected_bytes:
            return (
                f"bad KV chunk (offset {offset}, {nbytes} bytes, payload {size}, expected "
                f"offset {self._received} of {self.expected_bytes})"
            )
        self._start()
        self._buffer[offset : offset + size].copy_(torch.frombuffer(data, dtype=torch.uint8))
        self._received += size
        return None

    def on_metadata(self, record: MetadataRecord) -> None:
        self.metadata = record

    def expect_receive(self, nbytes: int) -> str | None:
        """A torch.distributed receive of `nbytes` is about to be posted; why not, if wrong."""
        if nbytes != self.expected_bytes:
            return f"prefill announced {nbytes} bytes of KV, we reserved {self.expected_bytes}"
        self._receiving = True
        if self._state.state is TransferState.BOOTSTRAPPING:
            self._state.advance(TransferState.TRANSFERRING)
        return None

    def on_received(self, buffer: torch.Tensor) -> int | None:
        """The posted receive completed into `buffer`: the total to finish the room with
        (`on_done`), or None while the room still waits for its metadata or has ended."""
        self._receiving = False
        if self._state.done:
            self._buffers.give(buffer)  # the room failed meanwhile: nothing reads it
            return None
        self._buffer, self._received = buffer, buffer.numel()
        if self._done_total is not None:
            return self._done_total
        # NOTE: the metadata comes before the data (see dist_plane): the receive is the room.
        return buffer.numel() if self.metadata is not None else None

    def on_done(self, total_bytes: int) -> str | None:
        """Prefill sent everything: None once the room is complete, "" while a receive is
        still in flight (called again when it lands), else what is missing."""
        if self._receiving:
            self._done_total = total_bytes
            return ""
        if total_bytes != self.expected_bytes or self._received != self.expected_bytes:
            return (
                f"incomplete KV: got {self._received} of {self.expected_bytes} bytes "
                f"(prefill sent {total_bytes})"
            )
        if self.metadata is None:
            return "room finished without its metadata record"
        self._start()
        self._state.advance(TransferState.SUCCESS)
        self.stamps["success"] = time.monotonic()
        return None

    def drop_buffer(self) -> None:
        """Recycle an ended room's buffer, unless it is there to be committed. (A receive
        still in flight holds its own buffer until `on_received`.)"""
        if self._buffer is not None and self._state.state is not TransferState.SUCCESS:
            self._buffers.give(self._buffer)
            self._buffer = None

    def _start(self) -> None:
        if self._buffer is None:
            self._buffer = self._buffers.take(self.expected_bytes)
        if self._state.state is TransferState.BOOTSTRAPPING:
            self._state.advance(TransferState.TRANSFERRING)
