"""One front-end pipeline for every generation endpoint: `prepare(state, ask) -> Prepared`.

An endpoint only translates its body into an `Ask` (its own field names, its own checks of
sizes before anything is tokenized, its tokenizer call) and renders what the engine returns
(JSON or SSE). Everything between is here, once, in this order:

1. the sampling settings, checked (types, bounds, token ids) before any prompt is tokenized;
2. the prompts, tokenized in a worker thread (a long prompt never stalls other streams);
3. each prompt checked against the context, its `max_new_tokens` set (the context's rest when
   the body gave none), its sampling settings built, one per choice (`seeds_for`);
4. the jobs' engine request ids (the request's id, `job_ids`);
5. the bootstrap fields checked against the worker's role;
6. the waiting queue's capacity.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.protocol.engine_messages import Bootstrap
from pdserve.server.generation import (
    API_NAMES,
    ServerState,
    bootstrap_of,
    check_capacity,
    check_prompt,
    job_ids,
    sampling_settings,
    seeds_for,
)

# An engine request: its id, its prompt's token ids, its sampling settings.
Job = tuple[str, list[int], dict[str, Any]]


@dataclass
class Ask:
    """A generation request as its endpoint read it."""

    # The prompts' token ids; called in a worker thread after the sampling settings passed.
    tokenize: Callable[[], list[list[int]]]
    # SamplingParams fields (None: not given), without `max_new_tokens`.
    sampling: dict[str, Any]
    # None: as many as the context leaves after the prompt.
    max_new_tokens: int | None
    # The engine request ids' base: the request's id, or the client's own (`exact_ids`).
    id_base: str
    n: int = 1
    # The client named the engine requests (SGLang's `rid`): a duplicate is refused, not
    # renamed (`generation.run_one`).
    exact_ids: bool = False
    # bootstrap_host, bootstrap_port, bootstrap_room as the body gave them.
    bootstrap: tuple[Any, Any, Any] = (None, None, None)
    # How errors name SamplingParams' fields (`max_new_tokens` is OpenAI's `max_tokens`).
    names: dict[str, str] = field(default_factory=lambda: API_NAMES)


@dataclass
class Prepared:
    jobs: list[Job]
    bootstrap: Bootstrap | None
    exact_ids: bool


async def prepare(state: ServerState, ask: Ask) -> Prepared:
    # NOTE: without a max_new_tokens, the context's length stands in for the bound each
    # prompt gets (so that min_new_tokens is checked against what it may really reach).
    bound = state.max_model_len if ask.max_new_tokens is None else ask.max_new_tokens
    sampling_settings(state, ask.names, max_new_tokens=bound, **ask.sampling)
    prompts = await asyncio.to_thread(ask.tokenize)
    settings: list[tuple[list[int], dict[str, Any]]] = []
    for prompt_ids in prompts:
        max_tokens = check_prompt(state, prompt_ids, ask.max_new_tokens)
        sampling = sampling_settings(state, ask.names, max_new_tokens=max_tokens, **ask.sampling)
        settings.extend((prompt_ids, s) for s in seeds_for(sampling, ask.n))
    ids = job_ids(ask.id_base, len(settings))
    jobs = [(i, prompt_ids, s) for i, (prompt_ids, s) in zip(ids, settings, strict=True)]
    bootstrap = bootstrap_of(state, *ask.bootstrap, len(jobs))
    check_capacity(state, len(jobs))
    return Prepared(jobs, bootstrap, ask.exact_ids)
