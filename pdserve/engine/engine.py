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
from typing import Any

import torch

from pdserve.engine.checkpoint.weights import read_tensor
from pdserve.engine.core.config import EngineConfig
from pdserve.engine.core.errors import InvalidRequestError, PromptTooLongError
from pdserve.engine.core.outputs import RequestOutput
from pdserve.engine.core.page_allocator import pages_needed
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.core.sampling_params import InvalidSamplingParams, SamplingParams
from pdserve.engine.core.scheduler import ScheduledBatch
from pdserve.engine.kv_connector import (
    KVConnector,
    KVFailed,
    KVLanded,
    KVReady,
    KVSent,
    PagesSettled,
)
from pdserve.engine.runtime.forward_batch import ForwardBatch, ForwardOutput
from pdserve.engine.runtime.overlap import InFlightStep, is_placeholder, placeholder
from pdserve.engine.speculator import Draft, Emitted, Proposals, Speculator
from pdserve.engine.startup import build_runtime, load_target
from pdserve.engine.text.detokenizer import RequestDetokenizer
from pdserve.protocol.engine_messages import Bootstrap, FinishReason
from pdserve.protocol.failures import Failure, FailureKind, FailureStage

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, speculator: Speculator | None = None):
        """`speculator` drafts and verifies (None: plain decoding); build the one
        `config.speculative` describes with `pdserve.speculative.build_speculator`. Start-up
        is `startup.py`'s, in three steps: the target, the draft beside it, the runtime."""
        if config.speculative is not None and speculator is None:
            raise ValueError(
                "speculative settings need a speculator: "
                "Engine(config, build_speculator(config.speculative)) (pdserve.speculative)"
            )
        self.config = config
        target = load_target(config)
        self.model_dir, self.model_config = target.model_dir, target.model_config
        self.device, self.dtype, self.tokenizer = target.device, target.dtype, target.tokenizer
        self.max_model_len = target.max_model_len
        self.attention_backend = target.attention_backend
        self.ranks, self.model = target.ranks, target.model
        self.speculator = speculator
        try:
            if speculator is not None:
                speculator.load(self)  # NOTE: draft models load before the KV pools are sized
            runtime = build_runtime(config, target, speculator, self.kv_tokens_for_transfer)
        except BaseException:
            self.close()  # NOTE: the other ranks do not outlive a failed start
            raise
        self.eos_token_ids, self.sampler = runtime.eos_token_ids, runtime.sampler
        self.max_pages_per_request, self.capture = runtime.max_pages_per_request, runtime.capture
        self.kv_pool, self.allocator = runtime.kv_pool, runtime.allocator
        self.prefix_cache, self.scheduler = runtime.prefix_cache, runtime.scheduler
        self.page_table, self.runner = runtime.page_table, runtime.runner
        self.requests: dict[str, Request] = {}
        # A prefill or decode worker's KV handoff (`connect`); None: colocated.
        self.connector: KVConnector | None = None
        # Disaggregated requests refused as they came, reported by `poll_transfers`.
        self._refused: list[RequestOutput] = []
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

    def trim_pages(self, request: Request, num_slots: int) -> None:
        """Free a request's pages past its first `num_slots` slots (a speculator's rejected
        KV)."""
        self.scheduler.trim_pages(request, num_slots)

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

    # ---- requests ---------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        bootstrap: Bootstrap | None = None,
    ) -> Request | None:
        """Validate and queue a request; raises InvalidRequestError (or a subclass) if it can
        never be served. A disaggregated worker's requests come with their `bootstrap` (the
        room their KV moves through): the connector takes them on, and one it refuses ends
        at once, reported by the next `poll_transfers` (None is returned)."""
        if (bootstrap is not None) != (self.connector is not None):
            raise InvalidRequestError(_role_mismatch(self.connector is not None))
        if bootstrap is not None:
            self._add_transfer(request_id, prompt, params, bootstrap)
            return self.requests.get(request_id)
        token_ids = self.validate_prompt(prompt)
        request = self._new_request(request_id, token_ids, params)
        self.scheduler.add(request)
        return request

    def _new_request(self, request_id: str, token_ids: list[int], params: SamplingParams):
        if request_id in self.requests or request_id in self.scheduler.transfers:
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

    # ---- disaggregation ------------------------------------------------------------------

    def connect(self, connector: KVConnector) -> None:
        """Make this a prefill or decode worker: `connector` moves its requests' KV (it calls
        this from its constructor)."""
        if self.connector is not None or self.requests:
            raise RuntimeError("connect a KV connector once, before any request")
        self.connector = connector

    @property
    def role(self) -> str:
        """The worker's role: the connector's ("prefill", "decode"), else colocated."""
        return self.connector.role if self.connector is not None else "colocated"

    @property
    def has_transfers(self) -> bool:
        """Requests wait outside the compute queues while their KV moves (the loop polls
        now and then while idle, for the transfers' deadlines)."""
        if self.connector is None:
            return False
        scheduler = self.scheduler
        return bool(scheduler.waiting_for_pages or scheduler.transfers)

    def count(self, status: RequestStatus) -> int:
        """How many requests are in `status` (FINISHED: those with pages still pinned)."""
        return self.scheduler.count(status)

    def reserve_pages(self, num_tokens: int) -> list[int] | None:
        """Pages for `num_tokens` of KV outside any request (training a draft fills them), or
        None if they are not free now. Give them back with `free_pages`."""
        return self.scheduler.reserve(pages_needed(num_tokens, self.config.page_size))

    def free_pages(self, pages: list[int]) -> None:
        self.allocator.free(pages)

    def _add_transfer(self, request_id: str, prompt, params: SamplingParams, bootstrap) -> None:
        """A disaggregated request: it starts in the connector's first phase; one refused at
        once ends here, its failure output reported by the next `poll_transfers`."""
        connector = self.connector
        prompt_ids = [int(t) for t in prompt] if not isinstance(prompt, str) else []
        failure = connector.screen(bootstrap)
        if failure is not None:
            self._refused.append(RequestOutput.failed(request_id, prompt_ids, failure))
            return
        try:
            token_ids = self.validate_prompt(prompt)
            request = self._new_request(request_id, token_ids, connector.sampling_params(params))
        except InvalidRequestError as e:
            failure = connector.rejected(request_id, bootstrap, e)
            self._refused.append(RequestOutput.failed(request_id, prompt_ids, failure))
            return
        request.status = connector.initial_status
        request.hold_pages = connector.keeps_pages
        if connector.keeps_pages:
            self._host_bound.add(request_id)
        failure = connector.add(request, bootstrap)
        if failure is not None:
            self._forget(request_id)
            self._refused.append(RequestOutput.failed(request_id, token_ids, failure))
            return
        self.scheduler.add(request)

    def poll_transfers(self) -> list[RequestOutput]:
        """Apply what the connector's transfers did (between steps): prefill requests whose
        pages decode reserved queue for compute, decode requests whose KV landed join the
        batch, sent ones let their pages go and report their first token, failed ones end;
        then decode reserves pages for queued requests. Returns the outputs of requests that
        ended or started producing."""
        if self.connector is None:
            return []
        outputs, self._refused = self._refused, []
        landed = []
        transfers = self.scheduler.transfers
        for event in self.connector.poll():
            request = transfers.get(event.request_id) or self.requests.get(event.request_id)
            if request is None:
                continue  # ended meanwhile
            status = request.status
            if isinstance(event, KVReady) and status is RequestStatus.WAITING_FOR_PEER:
                self.scheduler.start_compute(request)
            elif isinstance(event, KVLanded) and status is RequestStatus.RECEIVING_KV:
                landed.append((request, event.metadata))
            elif isinstance(event, KVSent) and status is RequestStatus.SENDING_KV:
                request.transfer = None
                self.scheduler.release_pinned(request)
                outputs.append(self._output(request, request.output_token_ids[-1:]))
            elif isinstance(event, KVFailed) and request.transfer is not None:
                outputs.append(self._end_transfer(request, event.failure))
            elif isinstance(event, PagesSettled) and status is RequestStatus.FINISHED:
                self.scheduler.release_pinned(request, cache=False)
        outputs.extend(self._join(landed))
        for request in self.scheduler.admit_transfers():
            failure = self.connector.admitted(request)
            if failure is not None:
                outputs.append(self._end_transfer(request, failure))
        return outputs

    def _end_transfer(self, request: Request, failure: Failure | None) -> RequestOutput:
        """End a request of the connector's before its handoff finished, wherever it is;
        its pages go, or stay pinned if the connector says a write may still reach them."""
        pin = self.connector.ended(request, failure)
        request.transfer = None
        if request.status is RequestStatus.SENDING_KV:
            self.scheduler.release_pinned(request)
        elif not request.finished:
            self.scheduler.finish(request, FinishReason.ABORT, pin_pages=pin)
        self._forget(request.request_id)
        request.detokenizer = None
        request.failure = failure
        return RequestOutput.failed(request.request_id, request.prompt_token_ids, failure)

    def _join(self, landed: list[tuple[Request, Any]]) -> list[RequestOutput]:
        """Decode: requests whose KV landed join the running batch with prefill's first
        token; with speculative decoding, the algorithm first turns their metadata into their
        first draft inputs (all of this poll's at once)."""
        if not landed:
            return []
        requests = [request for request, _ in landed]
        records = [record for _, record in landed]
        try:
            states = (
                self.speculator.seed_drafts(requests, records)
                if self.speculator is not None
                else [None] * len(requests)
            )
        except ValueError as e:
            failure = _join_failure(f"could not seed the draft: {e}")
            return [self._end_transfer(request, failure) for request in requests]
        outputs = []
        for request, record, state in zip(requests, records, states, strict=True):
            prompt_len = request.num_prompt_tokens
            if not 0 <= record.cached_tokens <= prompt_len:
                problem = (
                    f"{record.cached_tokens} cached tokens reported for a {prompt_len}-token prompt"
                )
                outputs.append(self._end_transfer(request, _join_failure(problem)))
                continue
            request.transfer = None
            request.num_computed_tokens = prompt_len
            request.draft_state = state
            request.num_cached_tokens = record.cached_tokens
            self.scheduler.join_running(request)
            top = record.first_top_logprobs
            if request.sampling_params.logprobs and record.first_logprob is not None:
                top = top or {}  # NOTE: keeps one top-N entry per token, even if empty
            outputs.append(
                self._accept_token(request, record.first_token, record.first_logprob, top)
            )
        return outputs

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
        """Abort a request wherever it is (its client went) and free its pages now (but
        pages a transfer may still write, see `KVConnector.ended`). False if unknown."""
        request = self.requests.get(request_id) or self.scheduler.transfers.get(request_id)
        if request is None or (request.finished and request.transfer is None):
            return False
        if request.transfer is not None:
            self._end_transfer(request, None)
            return True
        self._forget(request_id)
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
            return self._after_step(self._step_overlapped())
        landed = self._land(self.in_flight)
        batch = self._schedule()
        if not batch:
            return landed
        return self._after_step(landed + self._step_now(batch))

    def _after_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """A disaggregated worker's step: the connector hears of the prompt chunks computed
        and of the requests that sampled their last token (prefill: their KV goes now); such
        a request reports its first token once sent (`KVSent`)."""
        if self.connector is None:
            return outputs
        batch = self.current_batch
        for request in batch.requests if batch is not None else []:
            if request.transfer is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.connector.computed(request)
            elif request.status is RequestStatus.SENDING_KV:
                self.connector.finished(request)
        sending = self.scheduler.transfers
        return [
            o
            for o in outputs
            if (r := sending.get(o.request_id)) is None or r.status is not RequestStatus.SENDING_KV
        ]

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
        admitted, self.scheduler.admitted = self.scheduler.admitted, []
        for request in admitted:
            if request.transfer is not None:
                self.connector.started(request)
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
            pin = request.transfer is not None and self.connector.ended(request, failure)
            request.transfer = None
            if not request.finished:
                self.scheduler.finish(request, FinishReason.ABORT, pin_pages=pin, cache=False)
                self._forget(request.request_id)
                request.detokenizer = None
            elif request.status is RequestStatus.SENDING_KV:
                self.scheduler.release_pinned(request, cache=False)
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
            # NOTE: a prefill worker's pages stay (SENDING_KV); the connector sends them once
            # the step is over (`_after_step`: the draft has caught up on the prompt by then).
            self.scheduler.finish(request, reason, keep_pages=request.hold_pages)
            request.detokenizer = None
            self._forget(request.request_id)

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
            finish_reason=request.finish_reason,
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


def _join_failure(problem: str) -> Failure:
    """A decode request whose KV landed could not join the batch."""
    message = problem if problem.startswith("could not") else f"could not join the batch: {problem}"
    return Failure(FailureKind.INTERNAL, FailureStage.TRANSFER, message)


def _role_mismatch(disaggregated: bool) -> str:
    if disaggregated:
        return (
            "this is a disaggregated worker: requests need bootstrap_host, bootstrap_port and "
            "bootstrap_room (send them through `pdserve router`)"
        )
    return "this is a colocated worker: requests must not carry bootstrap fields"
