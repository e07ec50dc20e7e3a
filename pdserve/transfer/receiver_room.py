"""One room on the decode side of a handoff (see `decode_side`): its state, the pieces of KV
it received (see `kv_piece`), and the commit that writes them into the room's pages. The
decode worker's thread calls `abort` and `commit`; everything else runs on the IO thread (or
is handed to it by the data plane). State reads are safe from any thread."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from pdserve.protocol.failures import FailureKind
from pdserve.protocol.transfer_messages import KVPiece
from pdserve.transfer.backends.dist.head_slices import LinkPart
from pdserve.transfer.backends.ipc.shared_pools import process_gone
from pdserve.transfer.buffer_pool import BufferPool
from pdserve.transfer.kv_piece import PageSpan, PieceLedger
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
        num_cached_pages: int = 0,
    ):
        """page_ids: every target page of the room; the first `num_cached_pages` hold their
        KV already (this worker's prefix cache) and are neither received nor written."""
        timeout_s = client.config.progress_timeout_s
        super().__init__(
            room, RoomState(room, progress_timeout_s=timeout_s, on_change=client.doorbell.ring)
        )
        self._client = client
        self._buffers: BufferPool = client.buffers
        self.peer: Peer | None = None
        self.page_ids = page_ids
        self.draft_page_ids = draft_page_ids
        self.num_cached_pages = num_cached_pages
        self._pieces = PieceLedger(
            len(page_ids), len(draft_page_ids), client.page_bytes, num_cached_pages
        )
        self.expected_bytes = self._pieces.expected_bytes
        # NOTE: until the first byte, the room waits for the prefill worker's queue too.
        self._state.hold(client.config.queue_timeout_s)
        self.metadata: MetadataRecord | None = None
        self._all_sent = False  # prefill's RoomDone arrived and matched what was announced
        self.started_at = time.monotonic()
        # When each protocol step happened (monotonic clock), for latency breakdowns.
        self.stamps: dict[str, float] = {}
        # The prefill instance our transfer request went to (None: not sent yet), and whether
        # it was sent again after that prefill worker asked us to register first.
        self.instance: int | None = None
        self.retried = False
        # The `ipc` backend: the prefill process our transfer request went to, which may write
        # our pages (None: none asked yet), and whether it said its writes are over.
        self.writer_pid: int | None = None
        self.released = False

    # ---- the decode worker's thread --------------------------------------------------

    def abort(self, kind: FailureKind, message: str) -> None:
        """Fail the room and tell prefill. The pages may be freed once `pages_settled`: right
        after this returns, but with the `ipc` backend (nothing else writes them before
        `commit`)."""
        self._state.fail(kind, message)
        self._client.io.call(lambda: self._client.end_room(self, notify=True))

    def commit(self, stager: KVStager) -> MetadataRecord:
        """Write the received KV into this room's pages; call once, after SUCCESS."""
        if self._state.state is not TransferState.SUCCESS or not self._pieces.complete:
            raise RuntimeError(f"room {self.room} cannot commit in {self._state.state.name}")
        self.stamps["commit_start"] = time.monotonic()
        self._pieces.scatter(stager, self.room, self.page_ids, self.draft_page_ids)
        for buffer in self._pieces.buffers():
            self._buffers.give(buffer)
        self.stamps["commit_queued"] = time.monotonic()
        return self.metadata

    @property
    def pages_settled(self) -> bool:
        """No write into the room's pages can still land, so they may be reused: always,
        but with the `ipc` backend, where the prefill process writes them until the room
        succeeded, it said its writes are over (`RoomReleased`), or it is gone."""
        if self._state.state is TransferState.SUCCESS:
            return True
        with self._client.lock:
            pid, released = self.writer_pid, self.released
        return pid is None or released or process_gone(pid)

    # ---- IO thread -------------------------------------------------------------------

    def attach(self, peer: Peer) -> None:
        self.peer = peer

    def sent_to(self, instance: int | None, pid: int = 0) -> None:
        """Our transfer request went to this prefill instance (None: to be sent again), of
        process `pid` (the `ipc` backend; under the client's lock)."""
        self.instance = instance
        if self._client.backend.writes_decode_pages and instance is not None:
            self.writer_pid = pid

    def retry(self) -> bool:
        """The request may be sent once more (the prefill worker had forgotten us)."""
        if self.retried:
            return False
        self.retried, self.instance = True, None
        return True

    def on_piece(self, msg: KVPiece) -> torch.Tensor | str:
        """A piece was announced (tcp): the buffer its chunks go to, or what is wrong with it.
        NOTE: every bound is checked against our own reservation before a byte is allocated."""
        span = PageSpan(msg.first_page, msg.num_pages, msg.first_draft_page, msg.num_draft_pages)
        problem = self._pieces.check(msg.index, span, msg.nbytes)
        if problem is not None:
            return problem
        buffer = self._buffers.take(msg.nbytes)
        self._pieces.add(msg.index, span, buffer)
        self.stamps.setdefault("first_piece", time.monotonic())
        self._progress()
        return buffer

    def on_parts(
        self, msg: KVPiece, parts: list[LinkPart], sizes: list[int], writer=None
    ) -> dict[int, torch.Tensor] | str:
        """A piece was announced that travels in `parts` (per-rank-pair links; `sizes` their
        bytes): rank 0's buffers by prefill rank (receives into them are about to be posted
        on the CUDA stream `writer`), or what is wrong with it. NOTE: checked against our own
        reservation before a byte is allocated."""
        span = PageSpan(msg.first_page, msg.num_pages, msg.first_draft_page, msg.num_draft_pages)
        problem = self._pieces.check(msg.index, span, msg.nbytes)
        if problem is not None:
            return problem
        buffers = {
            part.src: self._buffers.take(size, writer=writer)
            for part, size in zip(parts, sizes, strict=True)
            if part.dst == 0
        }
        self._pieces.add_parts(msg.index, span, parts, buffers)
        self.stamps.setdefault("first_piece", time.monotonic())
        self._progress()
        return buffers

    def on_written(self, msg: KVPiece, ready: torch.cuda.Event | None) -> str | None:
        """A piece was written into our pages (`ipc`), complete once `ready` is (prefill's
        event, opened; None if written already): what is wrong with it, if anything."""
        span = PageSpan(msg.first_page, msg.num_pages, msg.first_draft_page, msg.num_draft_pages)
        problem = self._pieces.check(msg.index, span, msg.nbytes)
        if problem is not None:
            return problem
        self._pieces.add_written(msg.index, span, ready)
        now = time.monotonic()
        self.stamps.setdefault("first_piece", now)
        self.stamps["last_landed"] = now
        self._progress()
        return None

    def on_chunk(self, piece: int, offset: int, nbytes: int, data: memoryview | None) -> str | None:
        """Copy a KV chunk (tcp) into its piece; what is wrong with it, if anything."""
        size = len(data) if data is not None else -1
        target = self._pieces.chunk_target(piece, offset, nbytes)
        if isinstance(target, str):
            return target
        if size != nbytes:
            return f"KV chunk of piece {piece} announced {nbytes} bytes, carried {size}"
        target.copy_(torch.frombuffer(data, dtype=torch.uint8))
        self._pieces.landed(piece, nbytes)
        self.stamps["last_landed"] = time.monotonic()
        self._progress()
        return None

    def on_part_landed(self, piece: int, src: int, dst: int) -> None:
        """Part (src, dst) of piece `piece` landed (torch.distributed): here, or on rank
        `dst`, which reported it."""
        if self._pieces.part_landed(piece, src, dst):
            self.stamps["last_landed"] = time.monotonic()
            self._progress()

    @property
    def has_remote_parts(self) -> bool:
        """Ranks other than 0 received parts of this room (they hold them until told)."""
        return self._pieces.has_remote_parts

    def on_metadata(self, record: MetadataRecord) -> None:
        self.metadata = record

    def on_done(self, total_bytes: int, num_pieces: int) -> str | None:
        """Prefill sent (or posted) everything: what is missing, if anything. The room
        succeeds once its bytes have also landed (see `complete_now`)."""
        pieces = self._pieces
        if total_bytes != self.expected_bytes or pieces.announced_bytes != self.expected_bytes:
            return (
                f"incomplete KV: prefill sent {total_bytes} bytes in {num_pieces} pieces, "
                f"{pieces.announced_bytes} of the {self.expected_bytes} reserved were announced"
            )
        if num_pieces != len(pieces.pieces):
            return f"prefill sent {num_pieces} pieces, {len(pieces.pieces)} were announced"
        if self.metadata is None:
            return "room finished without its metadata record"
        self._all_sent = True
        return None

    def complete_now(self) -> bool:
        """Succeed if everything arrived (RoomDone seen, every byte landed); True if it did."""
        if not self._all_sent or not self._pieces.complete or self._state.done:
            return False
        self._progress()
        self._state.advance(TransferState.SUCCESS)
        self.stamps["success"] = time.monotonic()
        return True

    def drop_buffer(self) -> None:
        """Recycle an ended room's buffers, unless they are there to be committed. (A
        receive still in flight gives its own buffer back when it lands.)"""
        if self._state.state is not TransferState.SUCCESS:
            for buffer in self._pieces.buffers():
                self._buffers.give(buffer)

    def _progress(self) -> None:
        """The room moved: TRANSFERRING from its first piece, and a fresh deadline."""
        if self._state.state is TransferState.BOOTSTRAPPING:
            self._state.advance(TransferState.TRANSFERRING)
        elif self._state.state is TransferState.TRANSFERRING:
            self._state.restart_clock()
