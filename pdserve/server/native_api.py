"""SGLang's native API, so its router and `bench_serving --backend sglang` work unchanged:
POST /generate, GET /get_model_info, /get_server_info (and /model_info, /server_info),
GET /health_generate; and POST /abort_room, with which pdserve's router ends both legs of a
request it gave up on."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

import pdserve
from pdserve.edge.request_ids import MAX_REQUEST_ID_CHARS, new_request_id
from pdserve.server.access_log import scope_request_id
from pdserve.server.errors import APIError, bad_request
from pdserve.server.generation import (
    MAX_ROOM,
    ServerState,
    abort_room,
    check_job_count,
    check_text_size,
    fails_room_on_error,
    run_many,
)
from pdserve.server.json_body import StrictJSONRoute
from pdserve.server.pipeline import Ask, prepare
from pdserve.server.streaming import WatchfulStreamingResponse, whole_unless_client_left

router = APIRouter(route_class=StrictJSONRoute)

# SGLang sampling_params keys -> SamplingParams fields (same name unless listed).
_SAMPLING_KEYS = {
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "skip_special_tokens",
    "seed",
}
# SGLang's constrained-decoding keys, not implemented: refused (400 naming the key) rather
# than answered with unconstrained text.
UNSUPPORTED_SAMPLING_KEYS = ("regex", "json_schema", "ebnf", "structural_tag")
HEALTH_GENERATE_TIMEOUT_S = 20.0


class GenerateBody(BaseModel):
    """Types are strict (see openai_protocol); `sampling_params`' values are checked, as
    strictly, by SamplingParams."""

    model_config = ConfigDict(extra="ignore", strict=True)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # SGLang's PD fields (prefill and decode workers only; the router sets them).
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


class AbortRoomBody(BaseModel):
    model_config = ConfigDict(strict=True)

    bootstrap_room: int = Field(ge=0, le=MAX_ROOM)
    bootstrap_host: str | None = Field(default=None, max_length=255)
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    reason: str = Field(default="the router gave up on the request", max_length=200)


def _state(request: Request) -> ServerState:
    return request.app.state.pdserve


@router.post("/generate")
@fails_room_on_error
async def generate(body: GenerateBody, request: Request):
    state = _state(request)
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text and input_ids", param="text")
    single = isinstance(body.text, str) or (
        body.input_ids is not None and all(isinstance(t, int) for t in body.input_ids)
    )
    if body.rid is not None and len(body.rid) > MAX_REQUEST_ID_CHARS:
        raise bad_request(f"rid: at most {MAX_REQUEST_ID_CHARS} characters", param="rid")
    given = body.sampling_params or {}
    for key in UNSUPPORTED_SAMPLING_KEYS:
        if given.get(key) is not None:
            raise bad_request(
                f"sampling_params.{key} is not supported by this server; omit it",
                param=f"sampling_params.{key}",
            )
    # NOTE: like SGLang, other keys this server does not use are ignored.
    raw = {k: v for k, v in given.items() if k in _SAMPLING_KEYS}
    max_new_tokens = raw.pop("max_new_tokens", 128)
    logprobs = body.top_logprobs_num if body.return_logprob else None
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        check_job_count(state, len(texts), param="text")
        check_text_size(state, [len(t) for t in texts], param="text")

        def tokenize() -> list[list[int]]:
            return [state.tokenizer.encode(t) for t in texts]
    else:
        prompts = [body.input_ids] if single else [list(p) for p in body.input_ids]
        check_job_count(state, len(prompts), param="input_ids")

        def tokenize() -> list[list[int]]:
            return prompts

    # NOTE: SGLang's own `rid`, when given, names the engine requests as the client gave it.
    ask = Ask(
        tokenize=tokenize,
        sampling={**raw, "logprobs": logprobs},
        max_new_tokens=max_new_tokens,
        id_base=body.rid or scope_request_id(request.scope),
        exact_ids=bool(body.rid),
        bootstrap=(body.bootstrap_host, body.bootstrap_port, body.bootstrap_room),
        names={},
    )
    prepared = await prepare(state, ask)
    jobs, boot, exact = prepared.jobs, prepared.bootstrap, prepared.exact_ids
    if body.stream:
        return WatchfulStreamingResponse(
            _stream(state, jobs, boot, exact), media_type="text/event-stream"
        )
    results = await whole_unless_client_left(request, _collect(state, jobs, boot, exact))
    if isinstance(results, Response):
        return results
    return JSONResponse(results[0] if single else results)


def _result(job, state: dict, arrival: float) -> dict:
    rid, prompt_ids, _ = job
    finish = None
    if state["finish_reason"] == "length":
        finish = {"type": "length", "length": state["completion_tokens"]}
    elif state["finish_reason"] == "stop":
        finish = {"type": "stop", "matched": state["stop_reason"]}
    elif state["finish_reason"] is not None:
        finish = {"type": "abort", "message": state["error"]}
    meta = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": state["completion_tokens"],
        "cached_tokens": state["cached_tokens"],
        "e2e_latency": time.monotonic() - arrival,
    }
    if state["spec_verify_ct"]:
        # SGLang's fields: verify steps, and tokens per verify step.
        meta["spec_verify_ct"] = state["spec_verify_ct"]
        meta["spec_accept_length"] = state["spec_emitted_tokens"] / state["spec_verify_ct"]
    if state["logprobs"] is not None:
        meta["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(state["logprobs"], state["ids"], strict=True)
        ]
        meta["output_top_logprobs"] = [
            [[v, int(i), None] for i, v in top] for top in state["top_logprobs"]
        ]
    return {"text": state["text"], "output_ids": list(state["ids"]), "meta_info": meta}


def _new_states(jobs) -> list[dict]:
    return [
        {
            "text": "",
            "ids": [],
            "finish_reason": None,
            "stop_reason": None,
            "error": None,
            "completion_tokens": 0,
            "logprobs": None,
            "top_logprobs": [],
            "spec_verify_ct": 0,
            "spec_emitted_tokens": 0,
            "cached_tokens": 0,
        }
        for _ in jobs
    ]


def _update(state: dict, output, new_text: str) -> None:
    state["text"] += new_text
    state["ids"].extend(output.new_token_ids)
    state["completion_tokens"] = output.num_output_tokens
    state["spec_verify_ct"] = output.spec_verify_ct
    state["spec_emitted_tokens"] = output.spec_emitted_tokens
    state["cached_tokens"] = output.num_cached_tokens
    if output.new_logprobs is not None:
        state["logprobs"] = (state["logprobs"] or []) + list(output.new_logprobs)
        state["top_logprobs"].extend(output.new_top_logprobs or [[]] * len(output.new_token_ids))
    if output.finished:
        state["finish_reason"] = output.finish_reason
        state["stop_reason"] = output.stop_reason
        state["error"] = output.error


async def _collect(server: ServerState, jobs, bootstrap, exact_ids: bool) -> list[dict]:
    arrival = time.monotonic()
    states = _new_states(jobs)
    async for index, output, new_text in run_many(server, jobs, bootstrap, exact_ids=exact_ids):
        _update(states[index], output, new_text)
    return [_result(job, s, arrival) for job, s in zip(jobs, states, strict=True)]


async def _stream(server: ServerState, jobs, bootstrap, exact_ids: bool):
    arrival = time.monotonic()
    states = _new_states(jobs)
    try:
        async for index, output, new_text in run_many(server, jobs, bootstrap, exact_ids=exact_ids):
            _update(states[index], output, new_text)
            result = _result(jobs[index], states[index], arrival)
            result["index"] = index
            yield f"data: {json.dumps(result)}\n\n"
    except APIError as e:
        yield e.sse()
    yield "data: [DONE]\n\n"


@router.post("/abort_room")
async def abort_room_endpoint(body: AbortRoomBody, request: Request) -> dict:
    """End the disaggregated request of `bootstrap_room`: a router that gave up on a request
    (client gone, the other leg failed) calls both workers. Closing a leg's connection is not
    enough: a leg the router cancelled before it went out never reaches this worker, while the
    peer's transfer request for its room does (and would wait for it until the deadline)."""
    state = _state(request)
    if not state.role.disaggregated:
        raise bad_request("this is a colocated worker: it has no rooms", param="bootstrap_room")
    host, port = body.bootstrap_host, body.bootstrap_port
    found = abort_room(state, body.bootstrap_room, body.reason, host, port)
    return {"aborted": found}


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request) -> dict:
    state = _state(request)
    return {
        "model_path": state.client.ready.model_path,
        "tokenizer_path": state.client.ready.model_path,
        "served_model_name": state.served_model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "architecture": state.client.ready.architecture,
        **_role_fields(state),
    }


def _role_fields(state: ServerState) -> dict:
    """What SGLang's router reads to drive prefill/decode workers."""
    ready = state.client.ready
    return {
        "disaggregation_mode": "null" if ready.role == "colocated" else ready.role,
        "role": ready.role,
        "disaggregation_bootstrap_port": ready.bootstrap_port,
        "disaggregation_transfer_backend": state.role.transfer_backend,
        "page_size": ready.page_size,
    }


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request) -> dict:
    state = _state(request)
    ready = state.client.ready
    stats = state.client.stats
    return {
        **state.server_args,
        **_role_fields(state),
        "model_path": ready.model_path,
        "served_model_name": state.served_model_name,
        "version": pdserve.__version__,
        "max_total_num_tokens": ready.kv_pages_total * ready.page_size,
        "max_model_len": state.max_model_len,
        "device": ready.device,
        "dtype": ready.dtype,
        "internal_states": [
            {
                "num_running": stats.num_running,
                "num_waiting": stats.num_waiting,
                "kv_pages_used": stats.kv_pages_used,
                "kv_pages_total": stats.kv_pages_total,
                "num_steps": stats.num_steps,
                "step_seconds": stats.step_seconds,
                "batched_tokens": stats.batched_tokens,
                **_disagg_counters(stats),
            }
        ],
    }


def _disagg_counters(stats) -> dict:
    """The handoff's queues and counters (latencies go to /metrics, not here)."""
    if stats.disagg is None:
        return {}
    counters = dataclasses.asdict(stats.disagg)
    del counters["transfer_latencies"]
    return counters


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Healthy only if the engine can actually generate a token now."""
    state = _state(request)
    if not state.client.healthy:
        return Response(status_code=503)
    if state.role.disaggregated:
        # NOTE: a prefill or decode worker cannot generate alone; its engine answering
        # (above) is the check.
        return Response(status_code=200)
    job = (f"health-{new_request_id()}", [0], {"max_new_tokens": 1, "temperature": 0.0})

    async def one_token() -> None:
        async for _ in run_many(state, [job]):
            pass

    try:
        await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
    except (TimeoutError, APIError):
        return Response(status_code=503)
    return Response(status_code=200)
