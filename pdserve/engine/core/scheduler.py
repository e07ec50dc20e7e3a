"""Continuous batching with chunked prefill over a paged KV cache. Torch-free.

Each step the scheduler decides, per request, how many of its not-yet-computed tokens to run:
running requests first (one token each when decoding, the next chunk when a long prompt is
being prefilled), then waiting requests in arrival order while the prefill token budget,
`max_running_requests` and free pages allow. When a running request needs a page and none is
free, the most recently admitted request is preempted: its pages are freed and it goes back to
the front of the queue to be recomputed later (its generated tokens are kept).

With a prefix cache (prefix_cache.py), a request is admitted after the longest cached prefix
of its tokens (at least its last token is computed: it needs the logits), the pages it lets go
join the cache, and pages are evicted from the cache before anyone is refused or preempted.

A disaggregated worker's requests also wait here while their KV moves (`RequestStatus`):
decode's queue for page reservations (`admit_transfers`, oldest first, against the same
`max_running_requests` and pages as `schedule`), and the requests outside the compute queues
(`transfers`: waiting for their peer, receiving or sending KV, or finished with pages pinned
until no write can reach them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.engine.core.page_allocator import PageAllocator, pages_needed
from pdserve.engine.core.prefix_cache import PrefixCache
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.protocol.engine_messages import FinishReason


@dataclass
class ScheduledBatch:
    """The work of one step: `num_new_tokens[i]` tokens of `requests[i]`, from its
    `num_computed_tokens` on. A request samples a token when its chunk reaches its end."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(num_new_tokens)

    def samples(self, index: int) -> bool:
        request = self.requests[index]
        return request.num_computed_tokens + self.num_new_tokens[index] == request.num_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    max_running_requests: int
    prefill_token_budget: int
    split_prompts: bool
    # Pages for this many slots beyond the scheduled tokens (speculative decoding writes
    # draft and verification KV there; the engine trims what was rejected).
    lookahead: int = 0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: PageAllocator,
        prefix_cache: PrefixCache | None = None,
        transfer_slots: Callable[[int], int] = lambda num_prompt_tokens: num_prompt_tokens,
    ):
        """transfer_slots: KV slots a handoff moves for a prompt of that many tokens (what a
        decode reservation holds)."""
        self.config = config
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.transfer_slots = transfer_slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Decode: requests queued for a reservation of pages for their KV, oldest first.
        self.waiting_for_pages: deque[Request] = deque()
        # Requests outside the compute queues while their KV moves, by id (their status says
        # which phase), and finished ones whose pages stay pinned.
        self.transfers: dict[str, Request] = {}
        # The requests `schedule` moved from waiting to running (its caller takes them).
        self.admitted: list[Request] = []

    @property
    def num_unfinished(self) -> int:
        """Requests with compute to do (waiting or running)."""
        return len(self.waiting) + len(self.running)

    def count(self, status: RequestStatus) -> int:
        """How many requests are in `status` (FINISHED: those with pages still pinned)."""
        if status is RequestStatus.WAITING:
            return len(self.waiting)
        if status is RequestStatus.RUNNING:
            return len(self.running)
        if status is RequestStatus.WAITING_FOR_PAGES:
            return len(self.waiting_for_pages)
        return sum(1 for r in self.transfers.values() if r.status is status)

    def add(self, request: Request) -> None:
        """Queue a request: for compute (WAITING), or for its handoff's first phase
        (WAITING_FOR_PEER: outside the queues; WAITING_FOR_PAGES: decode's reservation
        queue)."""
        if request.status is RequestStatus.WAITING:
            self.waiting.append(request)
        elif request.status is RequestStatus.WAITING_FOR_PAGES:
            self.waiting_for_pages.append(request)
        elif request.status is RequestStatus.WAITING_FOR_PEER:
            self.transfers[request.request_id] = request
        else:
            raise ValueError(f"a new request cannot start in {request.status.name}")

    # ---- disaggregation ------------------------------------------------------------------

    def admit_transfers(self) -> list[Request]:
        """Decode: reserve pages for queued requests' KV, oldest first, while pages and
        `max_running_requests` allow (requests receiving KV count as running); returns those
        now RECEIVING_KV. First the cached pages holding the prompt's longest cached prefix,
        short of its last token (the transfer skips them), then free ones for the rest."""
        admitted = []
        receiving = self.count(RequestStatus.RECEIVING_KV)
        while self.waiting_for_pages:
            if self.num_unfinished + receiving >= self.config.max_running_requests:
                break
            request = self.waiting_for_pages[0]
            cached = self.cached_prefix(request.prompt_token_ids)
            held = self.prefix_cache.acquire(cached) if cached else []
            total = pages_needed(
                self.transfer_slots(request.num_prompt_tokens), self.config.page_size
            )
            fresh = self.reserve(total - len(held))
            if fresh is None:
                if cached:
                    self.prefix_cache.release(cached)
                break  # NOTE: FIFO: later requests wait behind the oldest
            self.waiting_for_pages.popleft()
            request.pages, request.cached_pages = held + fresh, cached
            request.status = RequestStatus.RECEIVING_KV
            self.transfers[request.request_id] = request
            admitted.append(request)
            receiving += 1
        return admitted

    def start_compute(self, request: Request) -> None:
        """Prefill: decode reserved pages for the request's KV: it queues for compute."""
        self._check(request, RequestStatus.WAITING_FOR_PEER)
        del self.transfers[request.request_id]
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def join_running(self, request: Request) -> None:
        """Decode: the prompt's KV is in the request's pages: it joins the running batch
        directly (no prefill; the next step decodes its first token)."""
        self._check(request, RequestStatus.RECEIVING_KV)
        del self.transfers[request.request_id]
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def release_pinned(self, request: Request, *, cache: bool = True) -> None:
        """Let a finished request's pinned pages go (sent, or no write can reach them)."""
        if self.transfers.get(request.request_id) is not request or not request.finished:
            raise ValueError(f"request {request.request_id} has no pinned pages")
        del self.transfers[request.request_id]
        self.release_pages(request, cache=cache)
        request.status = RequestStatus.FINISHED

    def _check(self, request: Request, status: RequestStatus) -> None:
        if request.status is not status:
            raise ValueError(
                f"request {request.request_id} is {request.status.name}, not {status.name}"
            )

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.prefill_token_budget
        scheduled: set[int] = set()
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            remaining = request.num_tokens - request.num_computed_tokens
            # NOTE: a decode step is one token and never counts against the prefill budget.
            count = remaining if remaining == 1 else self._chunk(remaining, budget, bool(batch))
            if count == 0 or not self._reserve(request, count, scheduled):
                continue
            if remaining > 1:
                budget -= count
            batch.add(request, count)
            scheduled.add(id(request))
        self._admit_waiting(batch, budget)
        return batch

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and len(self.running) < self.config.max_running_requests:
            request = self.waiting[0]
            cached = self._cached_prefix(request)
            start = len(cached) * self.config.page_size
            count = self._chunk(request.num_tokens - start, budget, bool(batch))
            if count == 0:
                return
            slots = start + count + self.config.lookahead
            needed = pages_needed(slots, self.config.page_size) - len(cached)
            # NOTE: referenced before any eviction below, which must not take these pages.
            pages = self.prefix_cache.acquire(cached) if cached else []
            # Keep one free page per running request so admitted work can keep decoding
            # without immediately preempting someone.
            if (self.running and not self._can_allocate(needed + len(self.running))) or (
                not self._can_allocate(needed)
            ):
                if cached:
                    self.prefix_cache.release(cached)
                return
            request.cached_pages = cached
            request.pages = pages + self.allocator.allocate(needed)
            request.num_computed_tokens = start
            if request.num_preemptions == 0:
                request.num_cached_tokens = start
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.admitted.append(request)
            batch.add(request, count)
            budget -= count

    def share_prompt_pages(self, unsettled: dict[int, int]) -> None:
        """Running requests' full pages of computed prompt KV join the prefix cache while
        the requests still run, so that a request admitted from now on reads them instead of
        computing the same prompt again (a burst of requests with one system prompt; the
        prompt a decode worker just received). `unsettled`: tokens per request (by `id`)
        whose step may still be running, and may still fail (overlap scheduling): a failed
        step's KV is never cached, so they wait for the next call."""
        if self.prefix_cache is None:
            return
        size = self.config.page_size
        for request in self.running:
            settled = request.num_computed_tokens - unsettled.get(id(request), 0)
            full = min(settled, request.num_prompt_tokens) // size
            if full > request.pages_offered:
                request.cached_pages += self.prefix_cache.adopt(
                    request.token_ids, request.pages, full * size, request.cached_pages
                )
                request.pages_offered = full

    def _cached_prefix(self, request: Request) -> list:
        return self.cached_prefix(request.token_ids, request.num_tokens)

    def cached_prefix(self, token_ids: Sequence[int], num_tokens: int | None = None) -> list:
        """The cached pages holding the longest prefix of the first `num_tokens` (default:
        all) of `token_ids`, short of the last of them (which must be computed for its
        logits, or sent: a handoff always moves the page holding it). Not referenced yet."""
        if self.prefix_cache is None:
            return []
        num_tokens = len(token_ids) if num_tokens is None else num_tokens
        return self.prefix_cache.match(token_ids, num_tokens - 1)

    def _can_allocate(self, count: int) -> bool:
        """Whether `count` pages can be taken now, after evicting cached pages if needed."""
        short = count - self.allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        return self.allocator.can_allocate(count)

    def reserve(self, count: int) -> list[int] | None:
        """`count` pages outside any request (a KV transfer fills them), evicting cached
        pages if needed; None if they cannot be had now."""
        if not self._can_allocate(count):
            return None
        return self.allocator.allocate(count)

    def _chunk(self, remaining: int, budget: int, batch_has_work: bool) -> int:
        """Prompt tokens to run now: all that fit the budget, split only when allowed."""
        if remaining <= budget:
            return remaining
        if self.config.split_prompts:
            return max(budget, 0)
        # Unsplittable prompts larger than the budget still run, alone in their step.
        return 0 if batch_has_work else remaining

    def _pages_for(self, request: Request, count: int) -> int:
        slots = request.num_computed_tokens + count + self.config.lookahead
        total = pages_needed(slots, self.config.page_size)
        return max(total - len(request.pages), 0)

    def _reserve(self, request: Request, count: int, scheduled: set[int]) -> bool:
        """Give `request` pages for `count` more tokens, preempting the newest running
        requests not yet scheduled this step. False if the request had to preempt itself."""
        needed = self._pages_for(request, count)
        if needed == 0:
            return True  # NOTE: most decode steps: the current page has room
        while not self._can_allocate(needed):
            victim = self._pick_victim(scheduled)
            self._preempt(victim)
            if victim is request:
                return False
        request.pages.extend(self.allocator.allocate(needed))
        return True

    def _pick_victim(self, scheduled: set[int]) -> Request:
        for request in reversed(self.running):
            if id(request) not in scheduled:
                return request
        raise RuntimeError("KV cache exhausted by requests already scheduled this step")

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.release_pages(request)
        request.num_computed_tokens = 0
        request.draft_state = None  # its draft KV went with its pages
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(
        self,
        request: Request,
        reason: FinishReason,
        *,
        keep_pages: bool = False,
        pin_pages: bool = False,
        cache: bool = True,
    ) -> None:
        """End a request wherever it is and let its pages go at once (into the prefix cache
        unless not `cache`: a failed step's KV is not trusted), unless `keep_pages` (prefill:
        SENDING_KV, until its KV has been sent) or `pin_pages` (FINISHED, until no write of
        a transfer can reach them): then they wait in `transfers` for `release_pinned`."""
        if request.finished:
            return
        status = request.status
        if status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif status is RequestStatus.WAITING_FOR_PAGES:
            self.waiting_for_pages.remove(request)
        else:
            del self.transfers[request.request_id]
        request.finish_reason = reason
        if keep_pages or pin_pages:
            request.status = RequestStatus.SENDING_KV if keep_pages else RequestStatus.FINISHED
            self.transfers[request.request_id] = request
            return
        self.release_pages(request, cache=cache)
        request.status = RequestStatus.FINISHED

    def trim_pages(self, request: Request, num_slots: int) -> None:
        """Free the pages past the first `num_slots` slots (rejected speculative KV)."""
        keep = max(pages_needed(num_slots, self.config.page_size), len(request.cached_pages))
        if len(request.pages) > keep:
            self.allocator.free(request.pages[keep:])
            del request.pages[keep:]
            request.pages_changed_from = min(request.pages_changed_from, keep)
            request.pages_mirrored = min(request.pages_mirrored, keep)

    def release_pages(self, request: Request, *, cache: bool = True) -> None:
        """Let the request's pages go: its full pages of computed KV into the prefix cache
        (if there is one and `cache`), the rest back to the allocator."""
        pages, cached = request.pages, request.cached_pages
        if not pages:
            return
        if self.prefix_cache is None:
            self.allocator.free(pages)
        else:
            if cache:
                spare = self.prefix_cache.insert(
                    request.token_ids, pages, _known_kv_tokens(request), len(cached)
                )
            else:
                spare = pages[len(cached) :]
            self.prefix_cache.release(cached)
            self.allocator.free(spare)
        request.pages = []
        request.cached_pages = []
        request.pages_offered = 0
        request.pages_changed_from = 0
        request.pages_mirrored = 0


def _known_kv_tokens(request: Request) -> int:
    """Computed tokens whose ids the host knows: with overlap scheduling the newest computed
    token can still be a placeholder (a negative id) until its step lands."""
    known = request.num_computed_tokens
    while known and request.token_ids[known - 1] < 0:
        known -= 1
    return known
