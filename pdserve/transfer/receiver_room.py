"""One room on the decode side of a handoff (see `decode_side`): its state, its pages, the
ledger of the KV pieces it was announced (see `kv_piece`) and the metadata record. Torch-free,
and no reference to the client: the data planes allocate and fill the pieces' buffers, the
client (on its IO thread) and the decode worker's `Receiver` change the room only through its
methods; any thread reads it. What is wrong with a message comes back as a `Failure`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.protocol.failures import Failure
from pdserve.protocol.transfer_messages import KVPiece
from pdserve.transfer.kv_piece import PageSpan, PieceLedger
from pdserve.transfer.metadata import MetadataRecord
from pdserve.transfer.room_state import Room, RoomState, TransferState, room_failure

if TYPE_CHECKING:
    from pdserve.transfer.backends.dist.head_slices import LinkPart
    from pdserve.transfer.peer import Peer

# Allocates a piece's receive buffer of this many bytes (the client's `BufferPool.take`).
Take = Callable[[int], object]


class ReceiverRoom(Room):
    def __init__(
        self,
        state: RoomState,
        page_ids: list[int],
        draft_page_ids: list[int],
        page_bytes: list[int],
        num_cached_pages: int = 0,
        *,
        queue_timeout_s: float,
    ):
        """page_ids: every target page of the room; the first `num_cached_pages` hold their
        KV already (this worker's prefix cache) and are neither received nor written.
        page_bytes: bytes per page of each pool. Until the first byte, the room waits up to
        `queue_timeout_s` (for the prefill worker's queue too)."""
        super().__init__(state.room, state)
        self.peer: Peer | None = None
        self.page_ids = page_ids
        self.draft_page_ids = draft_page_ids
        self.num_cached_pages = num_cached_pages
        self._pieces = PieceLedger(len(page_ids), len(draft_page_ids), page_bytes, num_cached_pages)
        self.expected_bytes = self._pieces.expected_bytes
        self._state.hold(queue_timeout_s)
        self.metadata: MetadataRecord | None = None
        self._all_sent = False  # prefill's RoomDone arrived and matched what was announced
        self.started_at = time.monotonic()
        # When each protocol step happened (monotonic clock), for latency breakdowns.
        self.stamps: dict[str, float] = {}
        # The prefill instance our transfer request went to (None: not sent yet), and whether
        # it was sent again after that prefill worker asked us to register first.
        self.instance: int | None = None
        self.retried = False

    def stamp(self, step: str, *, first: bool = False) -> None:
        """When `step` happened (`first`: only the first time)."""
        if not first or step not in self.stamps:
            self.stamps[step] = time.monotonic()

    # ---- the decode worker's thread --------------------------------------------------

    def scatter(self, stager) -> MetadataRecord:
        """Write the received KV into this room's pages (through `stager`); once, after
        SUCCESS. RuntimeError in any other state."""
        if self._state.state is not TransferState.SUCCESS or not self._pieces.complete:
            raise RuntimeError(f"room {self.room} cannot commit in {self._state.state.name}")
        self.stamp("commit_start")
        self._pieces.scatter(stager, self.room, self.page_ids, self.draft_page_ids)
        return self.metadata

    # ---- IO thread -------------------------------------------------------------------

    def attach(self, peer: Peer) -> None:
        self.peer = peer

    def sent_to(self, instance: int | None) -> None:
        """Our transfer request went to this prefill instance (None: to be sent again; under
        the client's lock)."""
        self.instance = instance

    def retry(self) -> bool:
        """The request may be sent once more (the prefill worker had forgotten us)."""
        if self.retried:
            return False
        self.retried, self.instance = True, None
        return True

    def on_piece(self, msg: KVPiece, take: Take) -> Failure | None:
        """A piece was announced (tcp): its buffer is taken from `take`; what is wrong with
        it, if anything. NOTE: every bound is checked against our own reservation before a
        byte is allocated."""
        span = _span(msg)
        problem = self._pieces.check(msg.index, span, msg.nbytes)
        if problem is not None:
            return problem
        self._pieces.add(msg.index, span, take(msg.nbytes))
        self.stamp("first_piece", first=True)
        self._progress()
        return None

    def on_parts(
        self, msg: KVPiece, parts: list[LinkPart], sizes: list[int], take: Take
    ) -> dict[int, object] | Failure:
        """A piece was announced that travels in `parts` (per-rank-pair links; `sizes` their
        bytes): rank 0's buffers (from `take`) by prefill rank, into which receives are about
        to be posted, or what is wrong with it. NOTE: checked against our own reservation
        before a byte is allocated."""
        span = _span(msg)
        problem = self._pieces.check(msg.index, span, msg.nbytes)
        if problem is not None:
            return problem
        buffers = {
            part.src: take(size) for part, size in zip(parts, sizes, strict=True) if part.dst == 0
        }
        self._pieces.add_parts(msg.index, span, parts, buffers)
        self.stamp("first_piece", first=True)
        self._progress()
        return buffers

    def on_written(self, msg: KVPiece, ready) -> Failure | None:
        """A piece was written into our pages (`ipc`), complete once `ready` is (prefill's
        CUDA event, opened; None if written already): what is wrong with it, if anything."""
        span = _span(msg)
        problem = self._pieces.check(msg.index, span, msg.nbytes)
        if problem is not None:
            return problem
        self._pieces.add_written(msg.index, span, ready)
        self.stamp("first_piece", first=True)
        self.stamp("last_landed")
        self._progress()
        return None

    def chunk_target(self, piece: int, offset: int, nbytes: int):
        """Where a tcp chunk's bytes go (a slice of its piece's buffer), or what is wrong
        with the chunk; `chunk_landed` once they were copied there."""
        return self._pieces.chunk_target(piece, offset, nbytes)

    def chunk_landed(self, piece: int, nbytes: int) -> None:
        self._pieces.landed(piece, nbytes)
        self.stamp("last_landed")
        self._progress()

    def on_part_landed(self, piece: int, src: int, dst: int) -> None:
        """Part (src, dst) of piece `piece` landed (torch.distributed): here, or on rank
        `dst`, which reported it."""
        if self._pieces.part_landed(piece, src, dst):
            self.stamp("last_landed")
            self._progress()

    @property
    def has_remote_parts(self) -> bool:
        """Ranks other than 0 received parts of this room (they hold them until told)."""
        return self._pieces.has_remote_parts

    def on_metadata(self, record: MetadataRecord) -> None:
        self.metadata = record

    def on_done(self, total_bytes: int, num_pieces: int) -> Failure | None:
        """Prefill sent (or posted) everything: what is missing, if anything. The room
        succeeds once its bytes have also landed (see `complete_now`)."""
        pieces = self._pieces
        if total_bytes != self.expected_bytes or pieces.announced_bytes != self.expected_bytes:
            return room_failure(
                f"incomplete KV: prefill sent {total_bytes} bytes in {num_pieces} pieces, "
                f"{pieces.announced_bytes} of the {self.expected_bytes} reserved were announced"
            )
        if num_pieces != len(pieces.pieces):
            return room_failure(
                f"prefill sent {num_pieces} pieces, {len(pieces.pieces)} were announced"
            )
        if self.metadata is None:
            return room_failure("room finished without its metadata record")
        self._all_sent = True
        return None

    def complete_now(self) -> bool:
        """Succeed if everything arrived (RoomDone seen, every byte landed); True if it did."""
        if not self._all_sent or not self._pieces.complete or self._state.done:
            return False
        self._progress()
        self._state.advance(TransferState.SUCCESS)
        self.stamp("success")
        return True

    def drop_buffers(self) -> list:
        """An ended room's buffers to recycle: none if it succeeded (they wait for `scatter`,
        then `take_buffers`). A receive still in flight gives its own buffer back when it
        lands."""
        if self._state.state is TransferState.SUCCESS:
            return []
        return self._pieces.buffers()

    def take_buffers(self) -> list:
        """Every buffer held and not in flight (to recycle)."""
        return self._pieces.buffers()

    def _progress(self) -> None:
        """The room moved: TRANSFERRING from its first piece, and a fresh deadline."""
        if self._state.state is TransferState.BOOTSTRAPPING:
            self._state.advance(TransferState.TRANSFERRING)
        elif self._state.state is TransferState.TRANSFERRING:
            self._state.restart_clock()


def _span(msg: KVPiece) -> PageSpan:
    return PageSpan(msg.first_page, msg.num_pages, msg.first_draft_page, msg.num_draft_pages)
