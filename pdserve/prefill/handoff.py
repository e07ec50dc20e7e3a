"""Prefill worker handoff: a request waits in the bootstrap queue until the decode worker
reserved pages for its room, then prefills (chunked when long) with its pages held, samples
the first token, and sends KV + metadata. Its pages are freed once the send ended.

Pages the decode worker holds already (the start of the prompt, in its prefix cache: the
previous turn of a conversation it decoded) are not sent; the prompt is still computed whole
here (or from this worker's own cache), as the first token needs it.

The KV leaves while the prompt is still being computed: after every step, the pages a chunk
completed are gathered (on the compute stream, right behind the chunk) and sent as a piece once
they add up to `--transfer-piece-bytes` (64 MiB by default; 0 sends the KV whole after the
prefill); the last piece, after the first token, takes the rest and the draft's KV. The data
plane orders each send after its gather by a CUDA event, so neither this loop nor the compute
stream waits for a transfer.

Queues, in order: `bootstrapping` (no compute yet: decode's free memory is our admission
control) -> `prefilling` (in the engine) -> `sending`. The HTTP response of the prefill leg
finishes when the room does: with the first token on success, with the reason on failure.
A prompt the engine rejects still fails the room, so the decode worker learns at once.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass

import torch

from pdserve.disagg.handoff_base import (
    DisaggHandoff,
    PendingRequest,
    counted_when_refused,
    ipc_pools,
    refusal_message,
)
from pdserve.disagg.per_rank_kv import PerRankKV
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.page_allocator import pages_needed
from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol.engine_messages import Bootstrap, DisaggStats, FailRoom
from pdserve.protocol.failures import Failure, FailureKind, FailureStage, log_level
from pdserve.transfer.backends import make_backend
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.kv_piece import OutgoingPiece, PageSpan
from pdserve.transfer.kv_staging import StagingError
from pdserve.transfer.metadata import MetadataRecord
from pdserve.transfer.prefill_side import PrefillTransferServer, SenderRoom
from pdserve.transfer.room_state import TransferState

logger = logging.getLogger(__name__)


@dataclass
class _Pending(PendingRequest):
    sender: SenderRoom
    first: RequestOutput | None = None  # the first-token output, reported when the room ends
    started: bool = False  # the engine began computing it (it left the engine's queue)
    num_pages: int = 0  # pages the transfer moves (target pool; the draft pool's are as many)
    # Target pages already sent as pieces, or that decode holds already (its prefix cache):
    # the room's first `sender.num_cached_pages` are never sent.
    pages_sent: int = 0


class PrefillHandoff(DisaggHandoff):
    role = "prefill"

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
        self.bootstrapping: dict[str, _Pending] = {}
        self.prefilling: dict[str, _Pending] = {}
        self.sending: dict[str, _Pending] = {}

    # ---- requests --------------------------------------------------------------------

    def add(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, bootstrap: Bootstrap
    ) -> RequestOutput | None:
        """Queue a request; returns a failure output if it is refused at once (the room is
        failed too, so the decode side is told)."""
        if bootstrap.room in self.rooms_in_use:
            return self.room_in_use(request_id, prompt_ids, bootstrap.room)
        early = self.failed_before_it_came(request_id, prompt_ids, bootstrap.room)
        if early is not None:
            return early
        sender = self.server.sender(bootstrap.room)
        try:
            self.engine.validate_prompt(prompt_ids)
        except InvalidRequestError as e:
            failure = _rejected(e)
            sender.abort(failure.kind, failure.message)
            self.server.release(bootstrap.room)
            self.ended.add(bootstrap.room)
            return self.refused(request_id, prompt_ids, failure)
        self.rooms_in_use.add(bootstrap.room)
        self.bootstrapping[request_id] = _Pending(request_id, prompt_ids, params, sender)
        return None

    def fail_room(self, msg: FailRoom) -> None:
        """Fail a room whose request never reached us (the front end refused it)."""
        if msg.room in self.rooms_in_use or msg.room in self.ended:
            return  # a live request owns it, or it already failed (and counted) here
        failure = Failure(msg.kind, FailureStage.BOOTSTRAP, refusal_message("prefill", msg))
        self.ended.add(msg.room, failure)
        self.server.sender(msg.room).abort(failure.kind, failure.message)
        self.server.release(msg.room)
        if counted_when_refused(msg.kind):
            self.failures[failure.label] += 1

    def abort(self, request_id: str) -> bool:
        for queue in (self.bootstrapping, self.prefilling, self.sending):
            pending = queue.get(request_id)
            if pending is not None:
                message = "the prefill request was aborted (client gone)"
                pending.sender.abort(FailureKind.ABORTED, message)
                if queue is self.prefilling:
                    self.engine.abort_request(request_id)
                self._end(queue, pending)
                return True
        return self.engine.abort_request(request_id)

    @property
    def busy(self) -> bool:
        return bool(self.bootstrapping or self.sending)

    # ---- progress --------------------------------------------------------------------

    def poll(self) -> list[RequestOutput]:
        """Move rooms along: start prefills whose reservation arrived, finish sent rooms."""
        self.send_rank_orders()
        outputs = []
        for pending in list(self.bootstrapping.values()):
            state = pending.sender.poll()
            if state is TransferState.WAITING_FOR_INPUT:
                self._start_prefill(pending, outputs)
            elif state is TransferState.FAILED:
                outputs.append(self._fail(self.bootstrapping, pending))
        self._mark_started()
        for pending in list(self.prefilling.values()):
            if pending.sender.poll() is TransferState.FAILED:
                self.engine.abort_request(pending.request_id)
                outputs.append(self._fail(self.prefilling, pending))
        self._stream_pieces()
        for pending in list(self.sending.values()):
            state = pending.sender.poll()
            if state is TransferState.SUCCESS:
                self._end(self.sending, pending)
                outputs.append(pending.first)
            elif state is TransferState.FAILED:
                outputs.append(self._fail(self.sending, pending))
        return outputs

    def _mark_started(self) -> None:
        """Rooms whose prefill left the engine's queue: their progress deadline starts now."""
        queued = [p for p in self.prefilling.values() if not p.started]
        if not queued:
            return
        waiting = {request.request_id for request in self.engine.scheduler.waiting}
        for pending in queued:
            if pending.request_id not in waiting:
                pending.started = True
                pending.sender.started()

    def on_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Take the first-token outputs of our prefills (they are reported when the send
        ends); pass everything else through."""
        passed = []
        for output in outputs:
            pending = self.prefilling.get(output.request_id)
            if pending is None:
                passed.append(output)
            elif output.finished:
                self._send(pending, output, passed)
        return passed

    def _start_prefill(self, pending: _Pending, outputs: list[RequestOutput]) -> None:
        del self.bootstrapping[pending.request_id]
        # The first token only: decode samples the rest. min_new_tokens stays >= 1 if it was,
        # so EOS is suppressed for the first token exactly as in colocated mode.
        params = dataclasses.replace(
            pending.params,
            max_new_tokens=1,
            min_new_tokens=min(pending.params.min_new_tokens, 1),
        )
        try:
            self.engine.add_request(pending.request_id, pending.prompt_ids, params, hold_pages=True)
        except InvalidRequestError as e:
            failure = _rejected(e)
            pending.sender.abort(failure.kind, failure.message)
            self._release_room(pending)
            outputs.append(self.refused(pending.request_id, pending.prompt_ids, failure))
            return
        tokens = self.engine.kv_tokens_for_transfer(len(pending.prompt_ids))
        pending.num_pages = pages_needed(tokens, self.engine.config.page_size)
        pending.pages_sent = pending.sender.num_cached_pages
        self.prefilling[pending.request_id] = pending

    def _stream_pieces(self) -> None:
        """Send the pages prefill completed since the last piece, once they are worth it."""
        piece_bytes = self.config.piece_bytes
        if piece_bytes <= 0:
            return
        page_size = self.engine.config.page_size
        bytes_per_page = self.transfer.stager.page_bytes[0]
        for pending in self.prefilling.values():
            request = self.engine.requests.get(pending.request_id)
            if request is None or pending.sender.done:
                continue
            complete = min(request.num_computed_tokens // page_size, pending.num_pages)
            count = complete - pending.pages_sent
            # NOTE: never the last page: the final piece always has one (and the draft's KV).
            count = min(count, pending.num_pages - 1 - pending.pages_sent)
            if count <= 0 or count * bytes_per_page < piece_bytes:
                continue
            span = PageSpan(pending.pages_sent, count)
            self._send_piece(pending.sender, request.pages, span)
            pending.pages_sent += count

    def _send_piece(
        self,
        sender: SenderRoom,
        pages: list[int],
        span: PageSpan,
        then: MetadataRecord | None = None,
    ) -> None:
        """Send the span's pages: written into decode's pages (`ipc`), else gathered; `then`,
        the last piece's, finishes the room (see `SenderRoom.send_piece`)."""
        if not self.ipc:
            sender.send_piece(self._piece(sender, pages, span), then)
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
        ready, event = self.server.write_event()
        piece = OutgoingPiece(span, None, ready, nbytes=nbytes, targets=peer_pools, event=event)
        sender.send_piece(piece, then)

    def _piece(self, sender: SenderRoom, pages: list[int], span: PageSpan) -> OutgoingPiece:
        """Gather the span's pages into buffers to send, with the event that orders the sends
        after the gather (and the copy to host memory, when sent from there). Per-rank-pair
        links: rank 0's parts, the other ranks told to send theirs."""
        stager = self.transfer.stager
        page_ids = span.page_lists(pages, pages, len(stager.pools))
        if isinstance(stager, PerRankKV):
            self.send_rank_orders()  # NOTE: the ranks' links to this peer are asked for first
            sends, remote = stager.gather_piece(sender.peer.links, page_ids)
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

    def _send(self, pending: _Pending, output: RequestOutput, passed: list) -> None:
        del self.prefilling[pending.request_id]
        if output.failure is not None or pending.request_id not in self.engine.held:
            message = "prefill ended without a first token"
            failure = output.failure or Failure(FailureKind.INTERNAL, FailureStage.ENGINE, message)
            pending.sender.abort(failure.kind, failure.message)
            self._release_room(pending)
            passed.append(self.refused(pending.request_id, pending.prompt_ids, failure))
            return
        request = self.engine.held[pending.request_id]
        pages = self.transfer.transfer_pages(self.engine, request.pages, len(pending.prompt_ids))
        # The last piece: every page not sent yet, and the draft's KV (whole) if any.
        rest = PageSpan(
            pending.pages_sent,
            len(pages) - pending.pages_sent,
            0,
            len(pages) if len(self.transfer.stager.pools) > 1 else 0,
        )
        top = output.top_logprobs[0] if output.top_logprobs else None
        seed = request.draft_state
        record = MetadataRecord(
            first_token=output.token_ids[0],
            first_logprob=output.logprobs[0] if output.logprobs else None,
            first_top_logprobs=dict(top) if top is not None else None,
            cached_tokens=request.num_cached_tokens,
            # The draft's state after the prompt (speculative decoding): seeds decode's draft.
            topk_p=None if seed is None else seed.topk_p,
            topk_index=None if seed is None else seed.topk_index,
            hidden_states=None if seed is None else seed.hidden,
        )
        pending.first = output
        self._send_piece(pending.sender, pages, rest, then=record)
        self.sending[pending.request_id] = pending

    # ---- endings ---------------------------------------------------------------------

    def _fail(self, queue: dict, pending: _Pending) -> RequestOutput:
        failure = pending.sender.failure
        logger.log(log_level(failure), "request %s failed: %s", pending.request_id, failure.message)
        self._end(queue, pending)
        return self.refused(pending.request_id, pending.prompt_ids, failure)

    def _end(self, queue: dict, pending: _Pending) -> None:
        queue.pop(pending.request_id, None)
        if pending.request_id in self.engine.held:
            self.engine.release_held(pending.request_id)
        self._release_room(pending)

    def _release_room(self, pending: _Pending) -> None:
        self.server.release(pending.sender.room)
        self.rooms_in_use.discard(pending.sender.room)
        self.ended.add(pending.sender.room)

    # ---- reporting -------------------------------------------------------------------

    def stats(self) -> DisaggStats:
        return self.transfer_stats(
            num_bootstrapping=len(self.bootstrapping),
            num_prefilling=len(self.prefilling),
            num_transferring=len(self.sending),
        )

    def stop(self) -> None:
        for pending in [*self.bootstrapping.values(), *self.prefilling.values()]:
            pending.sender.abort(FailureKind.UNAVAILABLE, "the prefill worker is shutting down")
        self.server.stop()


def _rejected(error: InvalidRequestError) -> Failure:
    message = f"prefill rejected the request: {error}"
    return Failure(FailureKind.INVALID, FailureStage.BOOTSTRAP, message)
