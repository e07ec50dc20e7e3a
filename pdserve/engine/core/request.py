"""A request's bookkeeping inside the engine: tokens, pages, progress, finish state.

Torch-free. One list, `token_ids` (prompt then output), plus `num_computed_tokens` (how many of
them have KV in the cache) describe every phase: prefill, chunked prefill, decode and
recompute after preemption all reduce to "compute tokens[num_computed:]".
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.protocol.engine_messages import FinishReason
from pdserve.protocol.failures import Failure
from pdserve.protocol.ids import PageIds, RequestId


class RequestStatus(enum.Enum):
    """Where a request is. Every worker: WAITING (queued for compute), RUNNING (in the
    batch), FINISHED. A disaggregated worker's requests also pass through the states of their
    KV's handoff (`kv_connector`):

    - prefill: WAITING_FOR_PEER (decode has not reserved pages for its KV yet: nothing is
      computed before) -> WAITING -> RUNNING -> SENDING_KV (computed, first token sampled,
      pages pinned while the KV goes) -> FINISHED;
    - decode: WAITING_FOR_PAGES (queued for a reservation, oldest first) -> RECEIVING_KV
      (pages reserved, KV arriving) -> RUNNING (joined with prefill's first token, no forward
      pass) -> FINISHED.
    """

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    WAITING_FOR_PEER = "waiting_for_peer"
    SENDING_KV = "sending_kv"
    WAITING_FOR_PAGES = "waiting_for_pages"
    RECEIVING_KV = "receiving_kv"

    @property
    def computes(self) -> bool:
        """In the scheduler's compute queues (waiting or running)."""
        return self in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(eq=False)
class Request:
    request_id: RequestId
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_total_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    # The output tokens appended so far (`append_token`), kept beside `token_ids` so a step's
    # output can hand over the list itself: a copy per step would cost O(n^2) over a request.
    # Unlike `token_ids` it never holds an overlap placeholder.
    output_token_ids: list[int] = field(init=False, default_factory=list)
    num_computed_tokens: int = 0
    pages: PageIds = field(default_factory=list)
    # Prefix caching: the cache's nodes of pages[:len(cached_pages)] (read, never written,
    # by this request) and how many prompt tokens the cache saved at its first admission.
    cached_pages: list[Any] = field(default_factory=list)
    # Full pages of computed prompt KV already offered to the cache while running (a page
    # the cache held already stays the request's own: not offered again).
    pages_offered: int = 0
    num_cached_tokens: int = 0
    # pages[pages_changed_from:] may differ from what the device page table last wrote: the
    # scheduler lowers it when it frees pages, the page table raises it when it writes them.
    pages_changed_from: int = 0
    # The same for the copies of the page list other tensor-parallel ranks keep (rank 0's
    # `RankGroup` raises it when it sends them the pages).
    pages_mirrored: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # The stop token id or stop string that ended the request, as vLLM reports it.
    stop_reason: int | str | None = None
    failure: Failure | None = None  # set when the engine failed it
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_preemptions: int = 0
    # Prefill worker: keep the pages when the request ends, until its KV was sent.
    hold_pages: bool = False
    # A disaggregated request: the KV connector's record of its handoff (its room), None
    # for a colocated one. Its phase is `status`.
    transfer: Any = None
    # Speculative decoding: the algorithm's state for the next draft (None until the draft
    # has seen the sequence: fresh, preempted), verify steps run and tokens they emitted.
    draft_state: Any = None
    spec_verify_steps: int = 0
    spec_emitted_tokens: int = 0
    # Per-request state owned by other components: the sampler's generator, the detokenizer
    # (only for requests with stop strings), the device page table's row.
    generator: Any = None
    detokenizer: Any = None
    page_table_row: Any = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        """No more tokens come: ended, or computed with its KV being sent (prefill)."""
        return self.status in (RequestStatus.FINISHED, RequestStatus.SENDING_KV)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
