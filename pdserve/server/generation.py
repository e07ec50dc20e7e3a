"""The request path every API shares: limits, prompt checks, sampling settings, running one
or several engine requests, their text, and metrics. API modules only translate bodies and
responses.

Text is made here, not in the engine: the engine process reports token ids, and each request
has a `RequestDetokenizer` in this process (engine/text/detokenizer.py), so detokenizing for clients
takes no time from the engine's steps.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.core.sampling_params import INT64_MIN, InvalidSamplingParams, SamplingParams
from pdserve.engine.text.detokenizer import RequestDetokenizer, TokenTexts
from pdserve.protocol.engine_messages import Bootstrap, TokenOutput
from pdserve.protocol.failures import Failure, FailureKind, FailureStage
from pdserve.server.engine_client import DuplicateRequestId, EngineClient, EngineUnavailable
from pdserve.server.errors import APIError, bad_request, failure_error
from pdserve.server.metrics import ServerMetrics
from pdserve.server.role import WorkerRole

# SamplingParams field -> the name clients use for it.
API_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}

# NOTE: text is measured before it is tokenized (tokenizing 10 MB takes half a minute and
# leaves the front end over a GB larger): a prompt longer than this many characters per token
# of the context cannot fit it. Real text averages 3-5 characters per token; only runs of
# repeated characters reach 16 or more.
MAX_PROMPT_CHARS_PER_TOKEN = 16


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Any
    served_model_name: str
    max_model_len: int
    metrics: ServerMetrics
    max_queued_requests: int
    role: WorkerRole
    server_args: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    # Disaggregated requests in flight: bootstrap_room -> engine request id (see abort_room).
    rooms: dict[int, str] = field(default_factory=dict)
    token_texts: TokenTexts = field(init=False)  # logprobs' token strings

    def __post_init__(self):
        self.token_texts = TokenTexts(self.tokenizer)


def job_ids(base: str, count: int) -> list[str]:
    """Engine request ids for the `count` jobs of one HTTP request: `base` for one, `base-0`,
    `base-1`, ... for more (`run_one` makes one unique where it is already in flight)."""
    return [base] if count == 1 else [f"{base}-{i}" for i in range(count)]


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.served_model_name:
        raise APIError(
            404,
            f"the model `{model}` does not exist; this server serves `{state.served_model_name}`",
            param="model",
            code="model_not_found",
        )


def check_capacity(state: ServerState, new_requests: int) -> None:
    if not state.client.healthy:
        raise failure_error(_engine_unavailable(state.client.health_detail))
    waiting = state.client.num_in_flight - state.client.stats.num_running
    if waiting + new_requests > state.max_queued_requests:
        raise APIError(
            429,
            f"the waiting queue is full ({state.max_queued_requests} requests); retry later",
            code="rate_limit_exceeded",
        )


def check_text_size(state: ServerState, lengths: list[int], param: str = "prompt") -> None:
    """Refuse text (given by its lengths in characters) that cannot fit the context, before
    any work is spent tokenizing it."""
    limit = MAX_PROMPT_CHARS_PER_TOKEN * state.max_model_len
    for length in lengths:
        if length > limit:
            raise APIError(
                400,
                f"{param}: {length} characters is over this worker's limit of {limit} "
                f"characters ({MAX_PROMPT_CHARS_PER_TOKEN} per token of the "
                f"{state.max_model_len}-token context)",
                param=param,
                code="context_length_exceeded",
            )


def check_job_count(state: ServerState, count: int, param: str = "prompt") -> None:
    """A request may not carry more prompts x choices than the waiting queue holds."""
    if count > state.max_queued_requests:
        raise bad_request(
            f"{count} prompts x choices in one request; this worker queues at most "
            f"{state.max_queued_requests}",
            param=param,
        )


def check_prompt(state: ServerState, prompt_ids: list[int], max_tokens: int | None) -> int:
    """Validate a tokenized prompt; return the max_tokens to use."""
    if not prompt_ids:
        raise bad_request("the prompt is empty", param="prompt")
    limit = state.max_model_len
    # NOTE: the length first: a token list of any size is refused without reading its ids.
    if len(prompt_ids) >= limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens; the prompt has "
            f"{len(prompt_ids)} tokens, leaving no room for output",
            param="prompt",
            code="context_length_exceeded",
        )
    vocab = state.client.ready.vocab_size
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
    if max_tokens is None:
        return limit - len(prompt_ids)
    # NOTE: a prefill worker generates one token; the decode worker checks the whole length.
    if len(prompt_ids) + max_tokens > limit and state.role.kind != "prefill":
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens; you requested "
            f"{len(prompt_ids) + max_tokens} ({len(prompt_ids)} in the prompt, {max_tokens} "
            "to generate)",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


MAX_ROOM = (1 << 63) - 1


def bootstrap_of(
    state: ServerState,
    host: str | None,
    port: int | None,
    room: int | None,
    num_jobs: int,
) -> Bootstrap | None:
    """The request's bootstrap fields, checked against this worker's role: required (and
    for exactly one prompt and choice) on prefill/decode workers, refused on colocated ones."""
    given = (host, port, room)
    if not state.role.disaggregated:
        if any(v is not None for v in given):
            raise bad_request(
                "this is a colocated worker: bootstrap_host/port/room are for prefill and "
                "decode workers",
                param="bootstrap_room",
            )
        return None
    if any(v is None for v in given):
        raise bad_request(
            f"this is a {state.role.kind} worker: requests need bootstrap_host, bootstrap_port "
            "and bootstrap_room (send them through `pdserve router`)",
            param="bootstrap_room",
        )
    if num_jobs != 1:
        raise bad_request(
            "disaggregated workers take one prompt with n=1 per request; send prompts "
            "(and choices) as separate requests",
            param="n",
        )
    if not 0 < port < 65536:
        raise bad_request(
            f"bootstrap_port must be in [1, 65535], got {port}", param="bootstrap_port"
        )
    if not 0 <= room <= MAX_ROOM:
        raise bad_request(
            f"bootstrap_room must be in [0, 2**63 - 1], got {room}", param="bootstrap_room"
        )
    return Bootstrap(host, port, room)


def refuse_room(
    state: ServerState,
    room: Any,
    reason: str,
    host: Any,
    port: Any,
    kind: FailureKind = FailureKind.INVALID,
) -> None:
    """A worker that refuses a disaggregated request before its engine sees it still fails
    the room, so the other side stops waiting at once (docs/architecture/transfer-states.md):
    a prefill worker fails its own room, a decode worker tells the prefill worker at
    host:port. `kind`: INVALID for a request at fault, else what ended it (a router giving
    up: ABORTED)."""
    if not state.role.disaggregated or not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
        return
    if state.role.kind == "prefill":
        state.client.fail_room(room, reason, kind=kind)
    elif isinstance(host, str) and host and isinstance(port, int) and 0 < port < 65536:
        state.client.fail_room(room, reason, host, port, kind=kind)


def _refusal_kind(status: int) -> FailureKind:
    """The failure a refused request passes to its room: the request's fault (4xx) stays
    INVALID everywhere; 429 and 5xx are this worker's state (a retry elsewhere may pass)."""
    if status == 429:
        return FailureKind.NO_PAGES
    return FailureKind.INVALID if status < 500 else FailureKind.UNAVAILABLE


def fails_room_on_error(handler):
    """Decorate an endpoint `(body, request)`: an APIError it raises also fails the room."""

    @functools.wraps(handler)
    async def endpoint(body, request):
        try:
            return await handler(body, request)
        except APIError as e:
            state = request.app.state.pdserve
            boot = (body.bootstrap_room, e.message, body.bootstrap_host, body.bootstrap_port)
            refuse_room(state, *boot, kind=_refusal_kind(e.status))
            raise

    return endpoint


def sampling_settings(
    state: ServerState, names: dict[str, str] = API_NAMES, **fields: Any
) -> dict[str, Any]:
    """Keep the fields that were set, check them with SamplingParams (types, bounds, token ids
    against the vocabulary), return them as a map. Errors name fields as `names` says."""
    settings = {k: v for k, v in fields.items() if v is not None}
    try:
        SamplingParams(**settings).check_vocab(state.client.ready.vocab_size)
    except InvalidSamplingParams as e:
        name = names.get(e.param, e.param)
        raise bad_request(str(e).replace(e.param, name, 1), param=name) from None
    except TypeError as e:
        raise bad_request(str(e)) from None
    if "stop" in settings:
        settings["stop"] = (
            [settings["stop"]] if isinstance(settings["stop"], str) else list(settings["stop"])
        )
    return settings


def seeds_for(sampling: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """n choices of one request: with a seed, choice i uses seed + i (wrapping within int64,
    the range seeds are checked against) so they differ."""
    seed = sampling.get("seed")
    if seed is None:
        return [sampling] * n
    return [{**sampling, "seed": (seed + i - INT64_MIN) % (1 << 64) + INT64_MIN} for i in range(n)]


async def run_one(
    state: ServerState,
    request_id: str,
    prompt_ids: list[int],
    sampling: dict[str, Any],
    bootstrap: Bootstrap | None = None,
    *,
    exact_id: bool = False,
) -> AsyncIterator[tuple[TokenOutput, str]]:
    """Stream one engine request's outputs, each with the text its new tokens add (never
    part of a stop string), recording latency and token metrics. An id already in flight
    here (a client reusing its `X-Request-Id`, two parts of a router's fan-out) gets a random
    suffix, so that it stays unique and still starts with the request's id; with `exact_id`
    (the client named the engine request: SGLang's `rid`) it is refused instead."""
    metrics = state.metrics
    # NOTE: `sampling` passed `sampling_settings`; the engine builds the same SamplingParams.
    detokenizer = RequestDetokenizer(state.tokenizer, prompt_ids, SamplingParams(**sampling))
    arrival = last = time.monotonic()
    first, finished = True, False
    # NOTE: no await from here to `generate` taking the id: no other request can take it.
    if not exact_id and state.client.in_flight(request_id):
        request_id = f"{request_id}-{secrets.token_hex(4)}"
    if bootstrap is not None:
        state.rooms[bootstrap.room] = request_id
    try:
        outputs = state.client.generate(request_id, prompt_ids, sampling, bootstrap)
        async for output in outputs:
            now = time.monotonic()
            if output.failure is not None:
                raise _output_error(state, output)
            if output.new_token_ids:
                if first:
                    metrics.time_to_first_token.observe(now - arrival)
                    metrics.prompt_tokens.inc(len(prompt_ids))
                    metrics.cached_prompt_tokens.inc(output.num_cached_tokens)
                    first = False
                else:
                    metrics.inter_token_latency.observe(now - last)
                metrics.generation_tokens.inc(len(output.new_token_ids))
                last = now
            if output.finished:
                finished = True
                metrics.e2e_request_latency.observe(now - arrival)
                metrics.request_finished(output.finish_reason or "abort")
                if output.spec_verify_ct:
                    metrics.spec_accept_length.observe(
                        output.spec_emitted_tokens / output.spec_verify_ct
                    )
            yield output, detokenizer.take_output(output.new_token_ids, finished=output.finished)
    except EngineUnavailable as e:
        raise failure_error(_engine_unavailable(str(e))) from None
    except DuplicateRequestId as e:
        raise bad_request(str(e), param="rid") from None
    finally:
        if bootstrap is not None and state.rooms.get(bootstrap.room) == request_id:
            del state.rooms[bootstrap.room]
        if not finished:  # the caller left early: the engine request was aborted
            metrics.request_finished("abort")


def abort_room(state: ServerState, room: int, reason: str, host: Any, port: Any) -> bool:
    """End a disaggregated request by its room, for a router that gave up on it: abort the
    engine request if it is here (True), else fail the room so that a leg or a transfer
    request for it that arrives later fails at once (`refuse_room`)."""
    request_id = state.rooms.get(room)
    if request_id is not None and state.client.cancel(request_id, reason):
        return True
    refuse_room(state, room, reason, host, port, kind=FailureKind.ABORTED)
    return False


def _output_error(state: ServerState, output: TokenOutput) -> APIError:
    """A failed request's error: its failure's kind gives the status (protocol/failures.py)
    and is the error's `code`, from which a router decides on a retry."""
    failure = output.failure
    if not state.client.healthy:
        # NOTE: whatever this request's own failure said, the engine is gone now.
        failure = _engine_unavailable(failure.message)
    return failure_error(failure)


def _engine_unavailable(reason: str) -> Failure:
    return Failure(FailureKind.UNAVAILABLE, FailureStage.ENGINE, f"engine unavailable: {reason}")


async def run_many(
    state: ServerState,
    jobs: list[tuple[str, list[int], dict[str, Any]]],
    bootstrap: Bootstrap | None = None,
    *,
    exact_ids: bool = False,
) -> AsyncIterator[tuple[int, TokenOutput, str]]:
    """Run several engine requests at once; yield (job index, output, new text) as they
    come. Leaving early cancels (and so aborts) every job still running. A disaggregated
    request (with `bootstrap`) is always a single job (see `bootstrap_of`). `exact_ids`:
    see `run_one`."""
    if len(jobs) == 1:
        async for output, new_text in run_one(state, *jobs[0], bootstrap, exact_id=exact_ids):
            yield 0, output, new_text
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, job) -> None:
        try:
            async for output, new_text in run_one(state, *job, exact_id=exact_ids):
                queue.put_nowait((index, (output, new_text)))
        except APIError as e:
            queue.put_nowait((index, e))
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield index, *item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
