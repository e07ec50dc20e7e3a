"""Prefill worker connector: a request waits for its peer (WAITING_FOR_PEER) until the decode
worker reserved pages for its room, then prefills (chunked when long) with its pages held,
samples the first token, and sends KV + metadata (SENDING_KV). Its pages are freed once the
send ended.

Pages the decode worker holds already (the start of the prompt, in its prefix cache: the
previous turn of a conversation it decoded) are not sent; the prompt is still computed whole
here (or from this worker's own cache), as the first token needs it.

The KV leaves while the prompt is still being computed: after every step, the pages a chunk
completed are gathered (on the compute stream, right behind the chunk) and sent as a piece once
they add up to `--transfer-piece-bytes` (64 MiB by default; 0 sends the KV whole after the
prefill); the last piece, after the first token, takes the rest and the draft's KV. The data
plane orders each send after its gather by a CUDA event, so neither this loop nor the compute
stream waits for a transfer.

Decode's free memory is our admission control: nothing is computed before its reservation.
The HTTP response of the prefill leg finishes when the room does: with the first token on
success, with the reason on failure. A prompt the engine rejects still fails the room, so the
decode worker learns at once.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass

import torch

from pdserve.disagg.connector_base import (
    DisaggConnector,
    counted_when_refused,
    ipc_pools,
    refusal_message,
)
from pdserve.disagg.per_rank_kv import PerRankKV
from pdserve.engine.core.page_allocator import pages_needed
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.kv_connector import KVFailed, KVReady, KVSent, TransferEvent
from pdserve.protocol.engine_messages import Bootstrap, DisaggStats, FailRoom
from pdserve.protocol.failures import Failure, FailureKind, FailureStage
from pdserve.transfer.backends import make_backend
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.kv_piece import OutgoingPiece, PageSpan
from pdserve.transfer.kv_staging import StagingError
from pdserve.transfer.metadata import MetadataRecord
from pdserve.transfer.prefill_side import PrefillTransferServer, Sender
from pdserve.transfer.room_state import TransferState

logger = logging.getLogger(__name__)


@dataclass
class _Handoff:
    """A prefill request's handoff (`Request.transfer`)."""

    sender: Sender
    started: bool = False  # the engine began computing it (it left the engine's queue)
    num_pages: int = 0  # pages the transfer moves (target pool; the draft pool's are as many)
    # Target pages already sent as pieces, or that decode holds already (its prefix cache):
    # the room's first `sender.num_cached_pages` are never sent.
    pages_sent: int = 0


class PrefillConnector(DisaggConnector):
    role = "prefill"
    initial_status = RequestStatus.WAITING_FOR_PEER
    keeps_pages = True

    def __init__(self, engine, config: TransferConfig):
        super().__init__(engine, config)
        backend = make_backend(config)
        self.send_device = backend.send_device(engine.device)
        self.ipc = backend.writes_decode_pages
        self.server = PrefillTransferServer(
            config,
            self.transfer.layout,
            self.transfer.metadata,
            f"prefill-{uuid.uuid4().hex[:8]}",
            self.metrics,
            device=self.send_device,
            source_device=engine.device,
            max_room_pages=pages_needed(
                engine.kv_tokens_for_transfer(engine.max_model_len), engine.config.page_size
            ),
            tp_size=engine.config.tp_size,
            ranks_host=self.ranks_host(),
            pools=ipc_pools(self.transfer.stager) if backend.needs_pools else None,
        )
        self.bootstrap_port = self.server.start()
        self.start_rank_links(self.server)
        self.doorbell = self.server.doorbell

    # ---- requests --------------------------------------------------------------------

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        return first_token_only(params)

    def rejected(self, request_id: str, bootstrap: Bootstrap, error: Exception) -> Failure:
        """Fail the room too, so the decode side is told."""
        message = f"prefill rejected the request: {error}"
        failure = Failure(FailureKind.INVALID, FailureStage.BOOTSTRAP, message)
        self.server.sender(bootstrap.room).abort(failure.kind, failure.message)
        self.server.release(bootstrap.room)
        self.recently_ended.add(bootstrap.room)
        return self.refused(request_id, failure)

    def add(self, request: Request, bootstrap: Bootstrap) -> Failure | None:
        request.transfer = _Handoff(self.server.sender(bootstrap.room))
        self.rooms_in_use.add(bootstrap.room)
        self.requests[request.request_id] = request
        return None

    def fail_room(self, msg: FailRoom) -> None:
        """Fail a room whose request never reached us (the front end refused it)."""
        if msg.room in self.rooms_in_use or msg.room in self.recently_ended:
            return  # a live request owns it, or it already failed (and counted) here
        failure = Failure(msg.kind, FailureStage.BOOTSTRAP, refusal_message("prefill", msg))
        self.recently_ended.add(msg.room, failure)
        self.server.sender(msg.room).abort(failure.kind, failure.message)
        self.server.release(msg.room)
        if counted_when_refused(msg.kind):
            self.failures[failure.label] += 1

    def ended(self, request: Request, failure: Failure | None) -> bool:
        """End the room (the first failure stands: one that failed there keeps its own)."""
        handoff: _Handoff = request.transfer
        if failure is None:
            message = "the prefill request was aborted (client gone)"
            handoff.sender.abort(FailureKind.ABORTED, message)
        else:
            handoff.sender.abort(failure.kind, failure.message)
            self.failed(request.request_id, failure)
        self._release_room(request)
        return False

    # ---- progress --------------------------------------------------------------------

    def poll(self) -> list[TransferEvent]:
        """Rooms whose reservation arrived may compute; sent rooms finish; failed ones end."""
        self.send_rank_orders()
        events: list[TransferEvent] = []
        for request in list(self.requests.values()):
            handoff: _Handoff = request.transfer
            state = handoff.sender.poll()
            if state is TransferState.FAILED:
                events.append(KVFailed(request.request_id, handoff.sender.failure))
            elif request.status is RequestStatus.WAITING_FOR_PEER:
                if state is TransferState.WAITING_FOR_INPUT:
                    tokens = self.engine.kv_tokens_for_transfer(request.num_prompt_tokens)
                    handoff.num_pages = pages_needed(tokens, self.engine.config.page_size)
                    handoff.pages_sent = handoff.sender.num_cached_pages
                    events.append(KVReady(request.request_id))
            elif request.status is RequestStatus.SENDING_KV and state is TransferState.SUCCESS:
                self._release_room(request)
                events.append(KVSent(request.request_id))
        return events

    def started(self, request: Request) -> None:
        """The prefill left the engine's queue: the room's progress deadline starts now."""
        handoff: _Handoff = request.transfer
        if not handoff.started:
            handoff.started = True
            handoff.sender.started()

    def computed(self, request: Request) -> None:
        """Send the pages prefill completed since the last piece, once they are worth it."""
        piece_bytes = self.config.piece_bytes
        handoff: _Handoff = request.transfer
        if piece_bytes <= 0 or handoff.sender.done:
            return
        bytes_per_page = self.transfer.stager.page_bytes[0]
        page_size = self.engine.config.page_size
        complete = min(request.num_computed_tokens // page_size, handoff.num_pages)
        count = complete - handoff.pages_sent
        # NOTE: never the last page: the final piece always has one (and the draft's KV).
        count = min(count, handoff.num_pages - 1 - handoff.pages_sent)
        if count <= 0 or count * bytes_per_page < piece_bytes:
            return
        self._send_piece(handoff.sender, request.pages, PageSpan(handoff.pages_sent, count))
        handoff.pages_sent += count

    def finished(self, request: Request) -> None:
        """The first token: send the last piece (every page not sent yet, and the draft's KV
        whole if any) with the metadata record; the pages stay until decode has it all."""
        handoff: _Handoff = request.transfer
        pages = self.transfer.transfer_pages(self.engine, request.pages, request.num_prompt_tokens)
        rest = PageSpan(
            handoff.pages_sent,
            len(pages) - handoff.pages_sent,
            0,
            len(pages) if len(self.transfer.stager.pools) > 1 else 0,
        )
        wanted = request.sampling_params.logprobs
        top = request.top_logprobs[0] if wanted and request.top_logprobs else None
        seed = request.draft_state
        record = MetadataRecord(
            first_token=request.output_token_ids[0],
            first_logprob=request.logprobs[0] if wanted is not None and request.logprobs else None,
            first_top_logprobs=dict(top) if top is not None else None,
            cached_tokens=request.num_cached_tokens,
            # The draft's state after the prompt (speculative decoding): seeds decode's draft.
            topk_p=None if seed is None else seed.topk_p,
            topk_index=None if seed is None else seed.topk_index,
            hidden_states=None if seed is None else seed.hidden,
        )
        self._send_piece(handoff.sender, pages, rest, then=record)

    def _send_piece(
        self,
        sender: Sender,
        pages: list[int],
        span: PageSpan,
        then: MetadataRecord | None = None,
    ) -> None:
        """Send the span's pages: written into decode's pages (`ipc`), else gathered; `then`,
        the last piece's, finishes the room (see `Sender.send_piece`)."""
        if not self.ipc:
            piece = self._piece(sender, pages, span)
            if piece is not None:
                sender.send_piece(piece, then)
            return
        destination = sender.destination(span)
        if destination is None:
            return  # the room ended: it takes no more writes
        peer_pools, peer_pages = destination
        stager = self.transfer.stager
        try:
            stager.write(span.page_lists(pages, pages, len(stager.pools)), peer_pools, peer_pages)
        except StagingError as e:
            sender.write_failed(f"could not write the KV into decode's pages: {e}")
            return
        nbytes = span.nbytes(stager.page_bytes)
        ready, event = self.server.plane.write_event()
        piece = OutgoingPiece(span, None, ready, nbytes=nbytes, targets=peer_pools, event=event)
        sender.send_piece(piece, then)

    def _piece(self, sender: Sender, pages: list[int], span: PageSpan) -> OutgoingPiece | None:
        """Gather the span's pages into buffers to send, with the event that orders the sends
        after the gather (and the copy to host memory, when sent from there). Per-rank-pair
        links: rank 0's parts, the other ranks told to send theirs; None if the peer's links
        are gone (it was dropped, and the room failed with it)."""
        stager = self.transfer.stager
        page_ids = span.page_lists(pages, pages, len(stager.pools))
        if isinstance(stager, PerRankKV):
            links = self.server.plane.links_of(sender.peer)
            if links is None:
                return None
            self.send_rank_orders()  # NOTE: the ranks' links to this peer are asked for first
            sends, remote = stager.gather_piece(links, page_ids)
            sends = [(dst, self._staged(data)) for dst, data in sends]
            nbytes = span.nbytes(stager.page_bytes)
            return OutgoingPiece(span, None, self._ready(), sends, remote, nbytes)
        data = self._staged(stager.gather(page_ids))
        return OutgoingPiece(span, data, self._ready())

    def _staged(self, data: torch.Tensor) -> torch.Tensor:
        """Gathered bytes where they are sent from: a GPU's copied to pinned host memory
        without blocking (tcp, gloo)."""
        if data.device.type != "cuda" or self.send_device.type == "cuda":
            return data
        staged = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True)
        staged.copy_(data, non_blocking=True)
        return staged

    def _ready(self) -> torch.cuda.Event | None:
        """An event after the gathers (and copies) queued so far; None on the CPU."""
        if self.engine.device.type != "cuda":
            return None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.engine.device))
        return ready

    # ---- endings ---------------------------------------------------------------------

    def _release_room(self, request: Request) -> None:
        handoff: _Handoff = self.requests.pop(request.request_id).transfer
        self.server.release(handoff.sender.room)
        self.rooms_in_use.discard(handoff.sender.room)
        self.recently_ended.add(handoff.sender.room)

    # ---- reporting -------------------------------------------------------------------

    def stats(self) -> DisaggStats:
        return self.transfer_stats(
            num_bootstrapping=len(self.in_phase(RequestStatus.WAITING_FOR_PEER)),
            num_prefilling=len(self.in_phase(RequestStatus.WAITING, RequestStatus.RUNNING)),
            num_transferring=len(self.in_phase(RequestStatus.SENDING_KV)),
        )

    def stop(self) -> None:
        for request in self.requests.values():
            if request.status is not RequestStatus.SENDING_KV:
                message = "the prefill worker is shutting down"
                request.transfer.sender.abort(FailureKind.UNAVAILABLE, message)
        self.server.stop()


def first_token_only(params: SamplingParams) -> SamplingParams:
    """What a prefill worker samples: the first token only (decode samples the rest).
    min_new_tokens stays >= 1 if it was, so EOS is suppressed for the first token exactly as
    in colocated mode."""
    return dataclasses.replace(
        params, max_new_tokens=1, min_new_tokens=min(params.min_new_tokens, 1)
    )
