"""OpenAI endpoints: /v1/completions, /v1/chat/completions, /v1/models.

Streaming follows OpenAI's Server-Sent Events: (chat) a role delta first, content deltas, the
finish_reason on each choice's last chunk, a usage chunk when `stream_options.include_usage`,
then `data: [DONE]`. An error after the stream started is sent as an SSE error event.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.text.chat_template import chat_prompt_ids
from pdserve.protocol.engine_messages import TokenOutput
from pdserve.server.access_log import scope_request_id
from pdserve.server.errors import APIError, bad_request
from pdserve.server.generation import (
    ServerState,
    check_job_count,
    check_model,
    check_text_size,
    fails_room_on_error,
    run_many,
)
from pdserve.server.json_body import StrictJSONRoute
from pdserve.server.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    check_supported,
)
from pdserve.server.pipeline import Ask, Prepared, prepare
from pdserve.server.streaming import WatchfulStreamingResponse, whole_unless_client_left

router = APIRouter(route_class=StrictJSONRoute)


def _state(request: Request) -> ServerState:
    return request.app.state.pdserve


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    state = _state(request)
    return {
        "object": "list",
        "data": [
            {
                "id": state.served_model_name,
                "object": "model",
                "created": int(state.started),
                "owned_by": "pdserve",
                "root": state.client.ready.model_path,
                "max_model_len": state.max_model_len,
            }
        ],
    }


@router.post("/v1/completions")
@fails_room_on_error
async def completions(body: CompletionRequest, request: Request):
    state = _state(request)
    check_model(state, body.model)
    check_supported(body)
    _check_completion_sizes(state, body.prompt, body.n)
    view = _View(
        "cmpl", "text_completion", state, body.logprobs is not None, False, _request_id(request)
    )
    ask = Ask(
        tokenize=lambda: _completion_prompts(state, body.prompt),
        sampling=_common_sampling(body, logprobs=body.logprobs),
        max_new_tokens=body.max_tokens,
        id_base=view.id,
        n=body.n,
        bootstrap=(body.bootstrap_host, body.bootstrap_port, body.bootstrap_room),
    )
    return await _respond(request, state, await prepare(state, ask), view, body)


@router.post("/v1/chat/completions")
@fails_room_on_error
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = _state(request)
    check_model(state, body.model)
    check_supported(body)
    if not body.messages:
        raise bad_request("messages must not be empty", param="messages")
    top = body.top_logprobs
    if top is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    if top is not None and not 0 <= top <= SamplingParams.MAX_LOGPROBS:
        # NOTE: checked here, not in SamplingParams, so the error names chat's own field.
        raise bad_request(
            f"top_logprobs: must be in [0, {SamplingParams.MAX_LOGPROBS}], got {top}",
            param="top_logprobs",
        )
    logprobs = (top or 0) if body.logprobs else None
    contents = chat_contents(state, body.messages)
    view = _View("chatcmpl", "chat.completion", state, body.logprobs, True, _request_id(request))
    template_args = (body.messages, contents, body.add_generation_prompt, body.chat_template_kwargs)
    ask = Ask(
        tokenize=lambda: [chat_prompt(state, *template_args)],
        sampling=_common_sampling(body, logprobs),
        max_new_tokens=body.max_completion_tokens or body.max_tokens,
        id_base=view.id,
        n=body.n,
        bootstrap=(body.bootstrap_host, body.bootstrap_port, body.bootstrap_room),
    )
    return await _respond(request, state, await prepare(state, ask), view, body)


def _request_id(request: Request) -> str:
    return scope_request_id(request.scope)


# ---- request translation ---------------------------------------------------------------


def _common_sampling(body, logprobs: int | None) -> dict[str, Any]:
    return {
        "min_new_tokens": body.min_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "seed": body.seed,
        "repetition_penalty": body.repetition_penalty,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "stop": [body.stop] if isinstance(body.stop, str) else body.stop,
        "stop_token_ids": body.stop_token_ids,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "ignore_eos": body.ignore_eos,
        "logprobs": logprobs,
        "skip_special_tokens": body.skip_special_tokens,
    }


def _check_completion_sizes(state: ServerState, prompt, n: int) -> None:
    """Bounds checked before any prompt is tokenized."""
    single = isinstance(prompt, str) or all(isinstance(p, int) for p in prompt)
    prompts = [prompt] if single else prompt
    check_job_count(state, len(prompts) * n)
    check_text_size(state, [len(p) for p in prompts if isinstance(p, str)])


def _completion_prompts(state: ServerState, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [state.tokenizer.encode(prompt)]
    if not prompt:
        raise bad_request("the prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [state.tokenizer.encode(p) for p in prompt]
    return [list(p) for p in prompt]


def chat_contents(state: ServerState, messages: list[ChatMessage]) -> list[str]:
    """Each message's text, checked for size before the template and tokenizer see it."""
    if len(messages) > state.max_model_len:
        raise bad_request(
            f"{len(messages)} messages cannot fit the {state.max_model_len}-token context",
            param="messages",
        )
    contents = []
    for index, message in enumerate(messages):
        content = message.content
        if content is None and message.role != "assistant":
            # NOTE: as OpenAI's API: only an assistant turn (one that called tools) may omit it.
            raise bad_request(
                f"messages[{index}].content is required for a {message.role} message",
                param=f"messages[{index}].content",
            )
        if isinstance(content, list):
            texts = [part.get("text") for part in content if part.get("type") == "text"]
            if len(texts) != len(content):
                raise bad_request("only text content parts are supported", param="messages")
            if not all(t is None or isinstance(t, str) for t in texts):
                raise bad_request("a text content part's text must be a string", "messages")
            content = "".join(t or "" for t in texts)
        contents.append(content or "")
    check_text_size(state, [sum(len(c) for c in contents)], param="messages")
    return contents


def chat_prompt(
    state: ServerState,
    messages: list,
    contents: list[str],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None,
) -> list[int]:
    """The prompt ids of chat `messages` (their text `contents`, from `chat_contents`) through
    the chat template: a template that fails on them is the request's 400."""
    turns = [
        {"role": message.role, "content": content}
        for message, content in zip(messages, contents, strict=True)
    ]
    try:
        return chat_prompt_ids(
            state.tokenizer,
            turns,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs,
        )
    except Exception as e:
        param = "chat_template_kwargs" if template_kwargs else "messages"
        raise bad_request(f"cannot apply the chat template: {e}", param=param) from None


# ---- responses -------------------------------------------------------------------------


class _View:
    """How one endpoint names and shapes its responses."""

    def __init__(
        self, prefix: str, obj: str, state: ServerState, logprobs: bool, chat: bool, request_id: str
    ):
        """`request_id`: the request's (its `X-Request-Id`, server/access_log.py); the
        response's id is `prefix-request_id`, as vLLM names it."""
        self.id = f"{prefix}-{request_id}"
        self.object = obj
        self.created = int(time.time())
        self.model = state.served_model_name
        self.token_text = state.token_texts
        self.logprobs = logprobs
        self.chat = chat
        self._chunk_head: str | None = None

    def envelope(self, streaming: bool, choices: list, usage: dict | None = None) -> dict:
        body = {
            "id": self.id,
            "object": self.object + (".chunk" if streaming and self.chat else ""),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return body

    def chunk_event(self, choice: dict) -> str:
        """One streamed chunk of one choice as an SSE event: `envelope(True, [choice])` in
        JSON, the envelope's fixed part encoded once per response instead of once a chunk."""
        if self._chunk_head is None:
            head = json.dumps(self.envelope(True, []))
            self._chunk_head = "data: " + head[: head.rindex("[]")]
        return f"{self._chunk_head}[{json.dumps(choice)}]}}\n\n"

    def logprob_block(self, outputs: list[TokenOutput], text_start: int = 0) -> dict | None:
        if not self.logprobs:
            return None
        ids = [t for o in outputs for t in o.new_token_ids]
        lps = [lp for o in outputs for lp in (o.new_logprobs or [])]
        tops = [top for o in outputs for top in (o.new_top_logprobs or [[]] * len(o.new_token_ids))]
        tokens = [self.token_text(t) for t in ids]
        if self.chat:
            return {
                "content": [
                    {
                        "token": token,
                        "logprob": lp,
                        "bytes": list(token.encode()),
                        "top_logprobs": [
                            {
                                "token": (s := self.token_text(int(i))),
                                "logprob": v,
                                "bytes": list(s.encode()),
                            }
                            for i, v in top
                        ],
                    }
                    for token, lp, top in zip(tokens, lps, tops, strict=True)
                ]
            }
        offsets, position = [], text_start
        for token in tokens:
            offsets.append(position)
            position += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": [{self.token_text(int(i)): v for i, v in top} for top in tops],
            "text_offset": offsets,
        }


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage block; `prompt_tokens_details.cached_tokens` are the prompt tokens
    served from the prefix cache, as OpenAI and vLLM report them."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


async def _respond(request, state, prepared: Prepared, view: _View, body):
    jobs, bootstrap = prepared.jobs, prepared.bootstrap
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return WatchfulStreamingResponse(
            _stream(state, jobs, view, include_usage, bootstrap), media_type="text/event-stream"
        )
    # NOTE: a non-streaming client that goes away must still abort its request.
    answer = await whole_unless_client_left(request, _collect(state, jobs, view, bootstrap))
    return answer if isinstance(answer, Response) else JSONResponse(answer)


async def _collect(state, jobs, view: _View, bootstrap) -> dict:
    outputs: list[list[TokenOutput]] = [[] for _ in jobs]
    texts: list[list[str]] = [[] for _ in jobs]
    async for index, output, new_text in run_many(state, jobs, bootstrap):
        outputs[index].append(output)
        texts[index].append(new_text)
    choices = []
    prompt_tokens = sum(len(ids) for i, (_, ids, _) in enumerate(jobs) if _is_first_choice(jobs, i))
    completion_tokens = 0
    for index, outs in enumerate(outputs):
        text = "".join(texts[index])
        last = outs[-1]
        completion_tokens += last.num_output_tokens
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": last.finish_reason,
            "logprobs": view.logprob_block(outs),
        }
        if view.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if last.stop_reason is not None:
            choice["stop_reason"] = last.stop_reason
        choices.append(choice)
    cached = sum(
        outs[-1].num_cached_tokens for i, outs in enumerate(outputs) if _is_first_choice(jobs, i)
    )
    return view.envelope(False, choices, _usage(prompt_tokens, completion_tokens, cached))


def _is_first_choice(jobs, index: int) -> bool:
    """Prompt tokens count once per prompt, not once per choice (n > 1)."""
    return index == 0 or jobs[index][1] is not jobs[index - 1][1]


async def _stream(state, jobs, view: _View, include_usage: bool, bootstrap) -> AsyncIterator[str]:
    def event(body: dict) -> str:
        return f"data: {json.dumps(body)}\n\n"

    # NOTE: a completions stream's text_offset counts each token's own text, as the
    # non-streamed answer does, so it does not depend on how the tokens were grouped into
    # events (a stream that falls behind gets several per event) or on detokenizer holdback.
    token_offset = [0] * len(jobs)
    completion_tokens = [0] * len(jobs)
    cached_tokens = [0] * len(jobs)
    # NOTE: chat's role chunk goes out with the first output, not before: a stream whose
    # first event is an error has sent nothing yet, so the router may still retry it.
    roles_sent = not view.chat
    try:
        async for index, output, new_text in run_many(state, jobs, bootstrap):
            if not roles_sent:
                roles_sent = True
                for i in range(len(jobs)):
                    delta = {"role": "assistant", "content": ""}
                    choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                    yield view.chunk_event(choice)
            completion_tokens[index] = output.num_output_tokens
            cached_tokens[index] = output.num_cached_tokens
            if not (new_text or output.finished or (view.logprobs and output.new_token_ids)):
                continue
            logprobs = view.logprob_block([output], token_offset[index])
            if logprobs is not None and not view.chat:
                token_offset[index] += sum(map(len, logprobs["tokens"]))
            choice: dict[str, Any] = {
                "index": index,
                "logprobs": logprobs,
                "finish_reason": output.finish_reason if output.finished else None,
            }
            if view.chat:
                choice["delta"] = {"content": new_text} if new_text else {}
            else:
                choice["text"] = new_text
            if output.finished and output.stop_reason is not None:
                choice["stop_reason"] = output.stop_reason
            yield view.chunk_event(choice)
        if include_usage:
            prompt_tokens = sum(
                len(ids) for i, (_, ids, _) in enumerate(jobs) if _is_first_choice(jobs, i)
            )
            cached = sum(c for i, c in enumerate(cached_tokens) if _is_first_choice(jobs, i))
            usage = _usage(prompt_tokens, sum(completion_tokens), cached)
            yield event(view.envelope(True, [], usage))
    except APIError as e:
        yield e.sse()
    yield "data: [DONE]\n\n"
