"""The engine: requests in, tokens out, one `step()` at a time.

It owns the model, the KV pool, the scheduler and the sampler. `step()` schedules, runs the
batch through one forward pass, and turns sampled tokens into outputs (stop checks, page
release). Outputs carry token ids; text is made by whoever reads them (the worker's front end,
`LLM.generate`), and the engine decodes only what stop strings need. It is single-threaded;
callers add and abort requests between steps.

Speculative decoding is a component, not a subclass: an engine built with a `Speculator`
(`pdserve.engine.speculator`) lets it draft for the requests that are ready, verifies the
drafts in the same forward pass as everything else, and emits what the speculator accepts
where a plain step would sample.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from transformers import AutoTokenizer

from pdserve.engine.attention import make_attention_backend
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu_threads import set_engine_threads
from pdserve.engine.decode_graphs import build_decode_graphs, graph_batch_size
from pdserve.engine.detokenizer import RequestDetokenizer
from pdserve.engine.errors import InvalidRequestError, PromptTooLongError
from pdserve.engine.forward_batch import Capture, ForwardBatch, ForwardOutput
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.loader import build_kv_pool, load_model, resolve_device, resolve_dtype
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_files import resolve_model_dir
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.overlap import InFlightStep, is_placeholder, placeholder
from pdserve.engine.page_allocator import PageAllocator, pages_needed
from pdserve.engine.page_table import DevicePageTable
from pdserve.engine.prefix_cache import CachedPage, PrefixCache, PromptPages
from pdserve.engine.rank_group import RankGroup
from pdserve.engine.request import FinishReason, Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import InvalidSamplingParams, SamplingParams
from pdserve.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from pdserve.engine.speculator import Draft, Emitted, Proposals, Speculator
from pdserve.engine.tensor_parallel import ModelSplit
from pdserve.engine.weights import read_tensor
from pdserve.protocol.failures import Failure, FailureKind, FailureStage

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, speculator: Speculator | None = None):
        """`speculator` drafts and verifies (None: plain decoding); build the one
        `config.speculative` describes with `pdserve.speculative.build_speculator`."""
        if config.speculative is not None and speculator is None:
            raise ValueError(
                "speculative settings need a speculator: "
                "Engine(config, build_speculator(config.speculative)) (pdserve.speculative)"
            )
        self.config = config
        # NOTE: a hub id or GGUF file becomes a local directory here (the CLI has usually
        # resolved it already: then this is the directory itself).
        self.model_dir = resolve_model_dir(config.model_path)
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config)
        if self.device.type == "cuda":
            # NOTE: cuda:N for everything this thread launches without naming a device.
            torch.cuda.set_device(self.device)
        # NOTE: one thread on GPU (a full OpenMP pool only contended with the server's other
        # processes: engine steps 2x slower on an H100 beside a busy HTTP front end); on CPU
        # the cores less one, split between the TP ranks (`cpu_threads`).
        set_engine_threads(self.device, config.cpu_threads, config.ranks_per_node)
        torch.manual_seed(config.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.attention_backend = make_attention_backend(config.attention_backend, self.device)
        # Tensor parallelism: this process is rank 0; the other ranks start now and load their
        # shares beside it (rank_group.py).
        self.ranks: RankGroup | None = None
        if config.tp_size > 1:
            split = ModelSplit.of(self.model_config, config.tp_size)
            self.ranks = RankGroup(config, self.model_dir, split, self.device, self.dtype)
        try:
            self._load(config, speculator)
        except BaseException:
            self.close()  # NOTE: the other ranks do not outlive a failed start
            raise

    def _load(self, config: EngineConfig, speculator: Speculator | None) -> None:
        """The rest of start-up: model, draft, KV pool, scheduler, graphs, runner."""
        self.model = load_model(
            self.model_dir,
            self.model_config,
            self.device,
            self.dtype,
            self.max_model_len,
            self.attention_backend,
            self.ranks.tp if self.ranks else None,
        )
        self.speculator = speculator
        if speculator is not None:
            speculator.load(self)  # NOTE: draft models load before the KV pools are sized
        self.eos_token_ids = self._eos_token_ids()
        self.sampler = Sampler(self.eos_token_ids)
        lookahead = speculator.lookahead_slots() if speculator else 0
        # The most pages a request can hold: max_model_len tokens and the speculative slots.
        self.max_pages_per_request = pages_needed(self.max_model_len + lookahead, config.page_size)
        # Target features every forward pass keeps for the draft.
        self.capture = speculator.target_capture() if speculator else Capture.NONE
        if self.ranks is not None:
            self.ranks.send_plan(
                self.capture,
                speculator.verify_tokens() if speculator else 0,
                self.max_pages_per_request,
            )
        self.kv_pool: KVPool = self._build_kv_pool()
        self.allocator = PageAllocator(self.kv_pool.num_pages)
        self.prefix_cache = self._build_prefix_cache()
        self.scheduler = Scheduler(
            SchedulerConfig(
                page_size=config.page_size,
                max_running_requests=config.max_running_requests,
                prefill_token_budget=config.prefill_token_budget,
                split_prompts=config.split_prompts,
                lookahead=lookahead,
            ),
            self.allocator,
            self.prefix_cache,
        )
        self.page_table = DevicePageTable(
            config.max_running_requests, self.max_pages_per_request, self.device
        )
        graph_args = (self.attention_backend, self.model, self.kv_pool, self.page_table)
        decode_graphs = build_decode_graphs(config, *graph_args, self.device, capture=self.capture)
        verify_graphs = None
        if speculator is not None:
            verify_graphs = build_decode_graphs(
                config,
                *graph_args,
                self.device,
                capture=self.capture,
                tokens_per_seq=speculator.verify_tokens(),
                share_pool_with=decode_graphs,
            )
            speculator.build_graphs(
                self.page_table,
                graph_batch_size(config, self.attention_backend) if decode_graphs else 0,
            )
        self.runner = ModelRunner(
            self.model,
            self.kv_pool,
            self.sampler,
            self.device,
            decode_graphs,
            verify_graphs,
            self.ranks,
            config.two_batch_overlap_tokens,
        )
        self.requests: dict[str, Request] = {}
        # Finished requests whose pages are kept for a KV transfer (see `hold_pages`).
        self.held: dict[str, Request] = {}
        self.last_batch_tokens = 0  # tokens computed by the latest step (for step statistics)
        # The batch the latest step scheduled (None while scheduling): what `fail_step` ends.
        self.current_batch: ScheduledBatch | None = None
        # Overlap scheduling (overlap.py): on CUDA, without a speculator, unless disabled. On
        # CPU there is nothing to overlap (tests turn it on to check the bookkeeping).
        self.overlap = speculator is None and not config.disable_overlap_schedule
        self.overlap &= self.device.type == "cuda"
        self.in_flight: InFlightStep | None = None  # launched, not landed yet
        self._previous_overlapped = False  # the last scheduled step was launched overlapped
        # Live requests whose tokens the host needs at once (`_overlaps`).
        self._host_bound: set[str] = set()
        logger.info(
            "engine ready: %s on %s%s (%s, %s attention), %d KV pages of %d tokens, "
            "max_model_len %d, prefix caching %s",
            self.model_config.architecture,
            self.device,
            f" and {config.tp_size - 1} more ranks" if self.ranks else "",
            self.dtype,
            type(self.attention_backend).__name__,
            self.kv_pool.num_pages,
            config.page_size,
            self.max_model_len,
            "on" if self.prefix_cache is not None else "off",
        )

    # ---- start-up -------------------------------------------------------------------------

    def _build_kv_pool(self) -> KVPool:
        """The target's pool, sized with the draft's pools beside it: they share its page ids,
        so each page costs both."""
        speculator = self.speculator
        pool = build_kv_pool(
            self.config,
            self.model_config,
            self.model,
            self.device,
            self.dtype,
            self.max_model_len,
            extra_page_bytes=speculator.draft_page_bytes() if speculator else 0,
            graph_batch=graph_batch_size(self.config, self.attention_backend, self.device),
            reserved_bytes=DevicePageTable.bytes_for(
                self.config.max_running_requests, self.max_pages_per_request
            ),
            tp=self.ranks.tp if self.ranks else None,
        )
        if speculator is not None:
            speculator.build_pools(pool.num_pages)
        return pool

    def _build_prefix_cache(self) -> PrefixCache | None:
        if self.config.disable_prefix_caching:
            return None
        if self.speculator is not None and self.speculator.draft_page_bytes():
            # NOTE: a draft's KV at a page's last slot depends on the next page's first token
            # (EAGLE reads x_{i+1} at position i), so a page's draft KV is not a function of
            # its own tokens and cannot be keyed by them. Drafts without KV (NGRAM) cache.
            logger.info("prefix caching is off: the speculative draft keeps KV of its own")
            return None
        return PrefixCache(self.allocator, self.config.page_size)

    @property
    def kv_pages_in_use(self) -> int:
        """Pages requests hold (their own and cached ones they read), plus any held for a
        transfer; cached pages no request reads are not counted: they are freed on demand."""
        unreferenced = self.prefix_cache.num_unreferenced if self.prefix_cache else 0
        return self.allocator.num_used - unreferenced

    def target_weight(self, name: str) -> torch.Tensor:
        """A whole weight of the target by checkpoint name (what a draft shares with it): the
        loaded parameter, or under tensor parallelism (each rank holds a slice) read from the
        checkpoint."""
        if self.ranks is None:
            return self.model.get_parameter(name)
        if name == "lm_head.weight" and self.model_config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        return read_tensor(self.model_dir, name, self.device).to(self.dtype)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do without them)."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    def kv_tokens_for_transfer(self, num_prompt_tokens: int) -> int:
        """Token slots of KV a handoff moves for a prompt of this length."""
        if self.speculator is None:
            return num_prompt_tokens
        return self.speculator.kv_tokens_for_transfer(num_prompt_tokens)

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # ---- requests ---------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        hold_pages: bool = False,
    ) -> Request:
        """Validate and queue a request; raises InvalidRequestError (or a subclass) if it can
        never be served. With `hold_pages` its pages outlive it (in `held`) until
        `release_held`: a prefill worker sends their KV first."""
        token_ids = self.validate_prompt(prompt)
        request = self._new_request(request_id, token_ids, params)
        request.hold_pages = hold_pages
        if hold_pages:
            self._host_bound.add(request_id)
        self.scheduler.add(request)
        return request

    def _new_request(self, request_id: str, token_ids: list[int], params: SamplingParams):
        if request_id in self.requests or request_id in self.held:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        try:
            params.check_vocab(self.model_config.vocab_size)
        except InvalidSamplingParams as e:
            raise InvalidRequestError(str(e), param=e.param) from None
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            max_total_tokens=min(len(token_ids) + params.max_new_tokens, self.max_model_len),
        )
        if params.seed is not None:
            request.generator = self.sampler.make_generator(self.device)
        if params.stop:
            # NOTE: only stop strings need text here (to know when the request stops); text
            # for clients is made outside the engine from the ids it reports (detokenizer.py).
            request.detokenizer = RequestDetokenizer(self.tokenizer, token_ids, params)
        self.requests[request_id] = request
        if params.logprobs is not None or params.uses_penalties:
            self._host_bound.add(request_id)
        return request

    # ---- disaggregation hooks -----------------------------------------------------------

    def reserve_pages(self, num_tokens: int) -> list[int] | None:
        """Pages for `num_tokens` of KV that a transfer will fill, or None if they are not
        free now (the caller waits: decode's free memory throttles prefill)."""
        return self.scheduler.reserve(pages_needed(num_tokens, self.config.page_size))

    def reserve_for_prompt(self, prompt_ids: list[int]) -> PromptPages | None:
        """The pages a transfer of this prompt's KV needs (decode side): first the cached
        pages that hold the prompt's longest cached prefix, short of its last token (referenced
        now; the transfer skips them), then free ones for the rest. None if they are not free
        now. Give them back with `release_reserved` unless `add_prebuilt` takes them."""
        cached = self.scheduler.cached_prefix(prompt_ids)
        held = self.prefix_cache.acquire(cached) if cached else []
        total = pages_needed(self.kv_tokens_for_transfer(len(prompt_ids)), self.config.page_size)
        fresh = self.scheduler.reserve(total - len(held))
        if fresh is None:
            if cached:
                self.prefix_cache.release(cached)
            return None
        return PromptPages(held + fresh, cached)

    def release_reserved(self, reserved: PromptPages) -> None:
        """A reservation no request took: its own pages freed, its cached ones released."""
        self.allocator.free(reserved.pages[len(reserved.cached) :])
        if reserved.cached:
            self.prefix_cache.release(reserved.cached)
        reserved.pages, reserved.cached = [], []

    def free_pages(self, pages: list[int]) -> None:
        self.allocator.free(pages)

    def add_prebuilt(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        pages: list[int],
        first_token: int,
        first_logprob: float | None = None,
        first_top_logprobs: dict[int, float] | None = None,
        draft_state=None,
        num_cached_tokens: int = 0,
        cached_pages: list[CachedPage] | None = None,
    ) -> RequestOutput:
        """Join the running batch with the prompt's KV already in `pages` (the decode side of
        a handoff) and the first token sampled elsewhere. No forward pass: the next step
        decodes from here. Returns the first token's output (it may already finish).
        `draft_state` is the speculative algorithm's first draft input (decode side);
        `num_cached_tokens` the prompt tokens the prefill side took from its prefix cache;
        `cached_pages` this worker's cached pages that begin `pages` (`reserve_for_prompt`:
        the request holds their references from now on).
        NOTE: admission (max_running_requests, free pages) is the decode worker's job: it
        reserved these pages before the transfer started."""
        token_ids = self.validate_prompt(prompt_token_ids)
        if pages_needed(len(token_ids), self.config.page_size) > len(pages):
            raise InvalidRequestError(
                f"{len(pages)} pages cannot hold the KV of a {len(token_ids)}-token prompt"
            )
        if not 0 <= num_cached_tokens <= len(token_ids):
            raise InvalidRequestError(
                f"{num_cached_tokens} cached tokens reported for a {len(token_ids)}-token prompt"
            )
        cached_pages = list(cached_pages or [])
        if [node.page for node in cached_pages] != list(pages[: len(cached_pages)]):
            raise InvalidRequestError("the cached pages given do not begin the request's pages")
        request = self._new_request(request_id, token_ids, params)
        request.pages = list(pages)
        request.cached_pages = cached_pages
        request.num_computed_tokens = len(token_ids)
        request.draft_state = draft_state
        request.num_cached_tokens = num_cached_tokens
        self.scheduler.add_running(request)
        if params.logprobs and first_logprob is not None and first_top_logprobs is None:
            first_top_logprobs = {}  # NOTE: keeps one top-N entry per token, even if empty
        return self._accept_token(request, first_token, first_logprob, first_top_logprobs)

    def release_held(self, request_id: str, *, cache: bool = True) -> list[int]:
        """Let the pages of a finished `hold_pages` request go (into the prefix cache unless
        not `cache`); returns them."""
        request = self.held.pop(request_id)
        pages = list(request.pages)
        self.scheduler.release_pages(request, cache=cache)
        return pages

    def validate_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt that can be served; raises InvalidRequestError otherwise."""
        token_ids = self._tokenize(prompt)
        self._check_fits(token_ids)
        return token_ids

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            token_ids = [int(t) for t in prompt]
            vocab = self.model_config.vocab_size
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}", param="prompt"
                )
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return token_ids

    def _check_fits(self, token_ids: list[int]) -> None:
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens; this model's maximum context length "
                f"is {self.max_model_len} tokens, including at least one generated token",
                param="prompt",
            )
        # NOTE: no capacity check per request: start-up guarantees the KV pool holds one
        # max_model_len sequence, so every accepted request fits once others finish.

    def abort_request(self, request_id: str) -> bool:
        """Abort a queued or running request and free its pages now. False if unknown."""
        request = self._forget(request_id)
        if request is None:
            return False
        self.scheduler.finish(request, FinishReason.ABORT)
        request.detokenizer = None
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.in_flight is not None

    # ---- the step ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, then sample (or verify the speculator's drafts) and
        post-process. Returns an output for every request that produced tokens (and for every
        request that finished): this step's, or with overlap scheduling the previous step's."""
        if self._overlaps():
            return self._step_overlapped()
        landed = self._land(self.in_flight)
        batch = self._schedule()
        if not batch:
            return landed
        return landed + self._step_now(batch)

    def _step_now(self, batch: ScheduledBatch) -> list[RequestOutput]:
        proposals = self.speculator.propose(batch) if self.speculator else Proposals({})
        drafts = proposals.drafts
        output = self.runner.forward(
            self._forward_batch(batch, drafts), self.capture, proposals.device_tokens
        )
        outputs = self._sample(batch, output, drafts) + self._verify(batch, output, drafts)
        if self.speculator:
            self.speculator.catch_up(batch, output, drafts)
        return outputs

    def _forget(self, request_id: str) -> Request | None:
        """Drop a request from the live ones (it finished or was aborted)."""
        self._host_bound.discard(request_id)
        return self.requests.pop(request_id, None)

    def _overlaps(self) -> bool:
        """Whether this step may overlap: every live request's tokens can be sampled on the
        device and reported a step late (no logprobs or penalties, no KV held for a
        transfer)."""
        return self.overlap and not self._host_bound

    def _step_overlapped(self) -> list[RequestOutput]:
        """Launch this step, then land the previous one while the GPU runs this one."""
        # NOTE: `in_flight` stays set until it lands: if this step raises first, `fail_step`
        # still finds its requests (and their placeholders).
        previous = self.in_flight
        batch = self._schedule()
        launched = None
        if batch:
            sampling = [i for i in range(len(batch)) if batch.samples(i)]
            requests = [batch.requests[i] for i in sampling]
            output = self.runner.forward(
                self._forward_batch(batch, {}),
                device_tokens=previous.tokens if previous is not None else None,
            )
            if sampling:  # NOTE: a step of prompt chunks alone has nothing to land
                tokens = self.runner.sample_on_device(output, sampling, requests)
                launched = InFlightStep(requests, tokens)
            for request, count in zip(batch.requests, batch.num_new_tokens, strict=True):
                request.num_computed_tokens += count
        outputs = self._land(previous)
        if launched is not None:
            # NOTE: after landing: a request that stopped there has no token to come.
            for index, request in enumerate(launched.requests):
                if not request.finished:
                    request.token_ids.append(placeholder(index))
            self.in_flight = launched
        return outputs

    def _land(self, step: InFlightStep | None) -> list[RequestOutput]:
        """Append an overlapped step's tokens in place of their placeholders; report them."""
        if step is None:
            return []
        self.in_flight = None
        outputs = []
        for request, token in zip(step.requests, step.token_ids(), strict=True):
            if request.finished:
                continue  # aborted, or stopped on the token before: this one is dropped
            request.token_ids.pop()  # its placeholder
            outputs.append(self._accept_token(request, token, None, None))
        return outputs

    def _schedule(self) -> ScheduledBatch:
        """This step's batch, remembered for `fail_step`. First, the prompt pages computed
        by steps that ended join the prefix cache (with overlap scheduling, the previous
        step's batch may still run: its tokens wait)."""
        if self.prefix_cache is not None:
            previous = self.current_batch if self._previous_overlapped else None
            unsettled = (
                {id(r): n for r, n in zip(previous.requests, previous.num_new_tokens, strict=True)}
                if previous is not None
                else {}
            )
            self.scheduler.share_prompt_pages(unsettled)
            self._previous_overlapped = self._overlaps()
        self.current_batch = None
        batch = self.scheduler.schedule()
        self.current_batch = batch
        self.last_batch_tokens = sum(batch.num_new_tokens)
        return batch

    def _forward_batch(self, batch: ScheduledBatch, drafts: dict[int, Draft]) -> ForwardBatch:
        """The scheduled tokens of each request; a drafted request's draft instead."""
        inputs = ForwardBatch()
        for index, (request, count) in enumerate(
            zip(batch.requests, batch.num_new_tokens, strict=True)
        ):
            start = request.num_computed_tokens
            draft = drafts.get(index)
            if draft is None:
                tokens = request.token_ids[start : start + count]
                inputs.add(request.pages, start, tokens, request=request)
            else:
                inputs.add(
                    request.pages,
                    start,
                    draft.token_ids,
                    draft.positions,
                    draft.mask,
                    request=request,
                )
        return inputs

    def fail_step(self, reason: str) -> list[RequestOutput]:
        """After `step()` raised: end every request of its batch (every running request if it
        raised while scheduling) with `reason`, free their pages, and report each one. A
        request that finished inside the failed step lost its output, so it is failed too."""
        batch = self.current_batch
        touched = list(batch.requests) if batch is not None else list(self.scheduler.running)
        if self.in_flight is not None:
            touched += [r for r in self.in_flight.requests if r not in touched]
            for request in self.in_flight.requests:
                if request.token_ids and is_placeholder(request.token_ids[-1]):
                    request.token_ids.pop()
            self.in_flight = None
        self.current_batch = None
        failure = Failure(FailureKind.INTERNAL, FailureStage.ENGINE, reason)
        outputs = []
        for request in touched:
            if not request.finished:
                self.scheduler.finish(request, FinishReason.ABORT, cache=False)
                self._forget(request.request_id)
                request.detokenizer = None
            elif request.request_id in self.held:
                self.release_held(request.request_id, cache=False)
            request.failure = failure
            outputs.append(self._output(request, []))
        return outputs

    def _sample(
        self, batch: ScheduledBatch, output: ForwardOutput, drafts: dict[int, Draft]
    ) -> list[RequestOutput]:
        """Requests without a draft: their scheduled tokens are computed now; each one whose
        chunk reached its end samples its next token."""
        plain = [i for i in range(len(batch)) if i not in drafts]
        sampling = [i for i in plain if batch.samples(i)]
        result = self.runner.sample(output, sampling, [batch.requests[i] for i in sampling])
        for i in plain:
            batch.requests[i].num_computed_tokens += batch.num_new_tokens[i]
        return [
            self._accept_token(
                batch.requests[i], result.token_ids[j], result.logprobs[j], result.top_logprobs[j]
            )
            for j, i in enumerate(sampling)
        ]

    def _verify(
        self, batch: ScheduledBatch, output: ForwardOutput, drafts: dict[int, Draft]
    ) -> list[RequestOutput]:
        """Requests with a draft: the speculator emits what the target agrees with (the
        speculator's `catch_up` then records what was computed)."""
        if not drafts:
            return []
        seqs = list(drafts)
        requests = [batch.requests[i] for i in seqs]
        logits = self.runner.logits(output, seqs)
        emitted = self.speculator.verify(requests, [drafts[i] for i in seqs], logits)
        return [self._emit(r, tokens) for r, tokens in zip(requests, emitted, strict=True)]

    def _emit(self, request: Request, emitted: list[Emitted]) -> RequestOutput:
        """Append a verification's tokens, up to the one that finishes the request, and
        report them."""
        request.spec_verify_steps += 1
        appended = []
        for token, logprob, top in emitted:
            self._append_token(request, token, logprob, top)
            appended.append(token)
            if request.finished:
                break
        request.spec_emitted_tokens += len(appended)
        return self._output(request, appended)

    def _accept_token(self, request: Request, token: int, logprob, top) -> RequestOutput:
        """Append a sampled token, apply stop conditions, and report it."""
        self._append_token(request, token, logprob, top)
        return self._output(request, [token])

    def _append_token(self, request: Request, token: int, logprob, top) -> None:
        """Append a token and apply stop conditions (the request may finish)."""
        request.append_token(token)
        if logprob is not None:
            request.logprobs.append(logprob)
            if top is not None:
                request.top_logprobs.append(top)
        if request.detokenizer is not None:
            request.detokenizer.append([token])
        reason = self._stop_reason(request, token)
        if reason is not None:
            self.scheduler.finish(request, reason, keep_pages=request.hold_pages)
            request.detokenizer = None
            self._forget(request.request_id)
            if request.hold_pages:
                self.held[request.request_id] = request

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        p = request.sampling_params
        detok = request.detokenizer
        if request.num_output_tokens >= p.min_new_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                return FinishReason.STOP
            if token in p.stop_token_ids:
                request.stop_reason = token
                return FinishReason.STOP
            if detok is not None and detok.stopped_by is not None:
                request.stop_reason = detok.stopped_by
                return FinishReason.STOP
        if request.num_tokens >= request.max_total_tokens:
            return FinishReason.LENGTH
        return None

    def _output(self, request: Request, new_tokens: list[int]) -> RequestOutput:
        want_logprobs = request.sampling_params.logprobs is not None
        want_top = bool(request.sampling_params.logprobs)
        count = len(new_tokens)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            # NOTE: the request's own lists, not copies (a copy per step is O(n^2)); they keep
            # growing while the request runs.
            token_ids=request.output_token_ids,
            new_token_ids=new_tokens,
            finished=request.finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            stop_reason=request.stop_reason,
            failure=request.failure,
            logprobs=request.logprobs if want_logprobs else None,
            top_logprobs=request.top_logprobs if want_top else None,
            new_logprobs=(
                request.logprobs[len(request.logprobs) - count :] if want_logprobs else None
            ),
            new_top_logprobs=(
                request.top_logprobs[len(request.top_logprobs) - count :] if want_top else None
            ),
            spec_verify_ct=request.spec_verify_steps,
            spec_emitted_tokens=request.spec_emitted_tokens,
            num_cached_tokens=request.num_cached_tokens,
        )
