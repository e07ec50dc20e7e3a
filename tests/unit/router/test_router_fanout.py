"""The router's fan-out: a request with several prompts or n > 1 becomes one room per (prompt,
choice), in colocated choice order with colocated seeds, and the answers merge back into one
(streamed and not); one room failing for good fails the request and ends every other room.
Fake workers (tests/unit/fake_workers.py); no torch, no engine. End-to-end against real
workers: tests/e2e/test_pd_fidelity.py."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from fastapi.testclient import TestClient

from pdserve.router.app import build_router_app
from pdserve.router.fanout import INT64_MAX, TooManyParts, split
from tests.unit.fake_workers import FakeWorkers, worker_error

# ---- splitting ---------------------------------------------------------------------------


def test_rooms_come_prompt_by_prompt_then_choice_by_choice_with_colocated_seeds():
    body = {"prompt": ["a", "b"], "n": 3, "seed": INT64_MAX - 1, "max_tokens": 4}
    parts = split("/v1/completions", body, limit=16, max_bytes=1 << 20)
    rooms = [(p.body["prompt"], p.body["seed"], p.body["n"]) for p in parts]
    # NOTE: seed + choice wraps within int64, as colocated `seeds_for` does.
    seeds = [INT64_MAX - 1, INT64_MAX, -(1 << 63)]
    assert rooms == [(prompt, seed, 1) for prompt in "ab" for seed in seeds]
    assert [p.first_of_prompt for p in parts] == [True, False, False] * 2
    assert all(p.body["max_tokens"] == 4 for p in parts)


def test_token_id_prompts_and_generate_batches_split_one_room_per_prompt():
    parts = split("/v1/completions", {"prompt": [[1, 2], [3]]}, limit=16, max_bytes=1 << 20)
    assert [p.body["prompt"] for p in parts] == [[1, 2], [3]]
    batch = {"input_ids": [[1], [2, 3]], "rid": "job", "sampling_params": {}}
    parts = split("/generate", batch, limit=16, max_bytes=1 << 20)
    assert [(p.body["input_ids"], p.body["rid"]) for p in parts] == [
        ([1], "job-0"),
        ([2, 3], "job-1"),
    ]
    parts = split("/generate", {"text": ["x", "y", "z"]}, limit=16, max_bytes=1 << 20)
    assert [p.body["text"] for p in parts] == ["x", "y", "z"]


@pytest.mark.parametrize(
    "endpoint, body",
    [
        ("/v1/completions", {"prompt": "one"}),
        ("/v1/completions", {"prompt": [1, 2, 3]}),  # one prompt of token ids
        ("/v1/completions", {"prompt": ["a", [1]], "n": 1}),  # mixed: the worker says why
        ("/v1/completions", {"prompt": [], "n": 1}),
        ("/v1/chat/completions", {"messages": [], "n": "2"}),  # not an integer
        ("/v1/chat/completions", {"messages": [], "n": True}),
        ("/v1/chat/completions", {"messages": [], "n": 0}),
        ("/v1/chat/completions", {"messages": [], "n": 129}),  # over the workers' bound
        ("/generate", {"text": "one"}),
        ("/generate", {"input_ids": [1, 2]}),
        ("/generate", {"text": ["a"], "input_ids": [[1]]}),  # both: the worker refuses
    ],
)
def test_what_the_router_cannot_split_goes_on_as_it_is(endpoint, body):
    (part,) = split(endpoint, body, limit=16, max_bytes=1 << 20)
    assert part.body is body


def test_a_seed_out_of_range_is_not_wrapped_into_a_valid_one():
    parts = split(
        "/v1/chat/completions",
        {"messages": [], "n": 2, "seed": 1 << 64},
        limit=4,
        max_bytes=1 << 20,
    )
    assert [p.body["seed"] for p in parts] == [1 << 64, 1 << 64]  # the worker refuses it


def test_more_rooms_than_the_limit_is_refused_naming_the_field():
    with pytest.raises(TooManyParts, match="3 prompts x 2 choices") as e:
        split("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}, limit=5, max_bytes=1 << 20)
    assert e.value.param == "n"
    with pytest.raises(TooManyParts) as e:
        split("/generate", {"text": ["a", "b"]}, limit=1, max_bytes=1 << 20)
    assert e.value.param == "text"


# ---- merging, through the router --------------------------------------------------------


def _completion(body: dict) -> dict:
    """What a fake decode worker answers: the prompt and seed it got, so the merged answer
    shows which room each choice came from."""
    text = f"{body.get('prompt')}|{body.get('seed')}"
    return {
        "id": f"cmpl-{body['bootstrap_room']}",
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 2, "total_tokens": 0},
    }


def _sse(*events) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


async def _decode(body: dict) -> httpx.Response:
    answer = _completion(body)
    if not body.get("stream"):
        return httpx.Response(200, json=answer)
    choice = answer["choices"][0]
    first = {**answer, "choices": [{**choice, "text": choice["text"][:1], "finish_reason": None}]}
    rest = {**answer, "choices": [{**choice, "text": choice["text"][1:]}]}
    usage = {**answer, "choices": [], "usage": answer["usage"]}
    events = (first, rest, usage) if body.get("stream_options") else (first, rest)
    del first["usage"], rest["usage"]
    return httpx.Response(200, content=_sse(*events))


def _router(fakes: FakeWorkers, **options) -> TestClient:
    return TestClient(build_router_app(fakes.config(**options), fakes.transport))


def test_a_prompt_list_with_n_merges_into_one_answer_in_colocated_order():
    fakes = FakeWorkers(decode=_decode)
    body = {"prompt": ["a", "bb"], "n": 2, "seed": 7, "max_tokens": 2}
    with _router(fakes) as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [(c["index"], c["text"]) for c in answer["choices"]] == [
        (0, "a|7"),
        (1, "a|8"),
        (2, "bb|7"),
        (3, "bb|8"),
    ]
    # A prompt's tokens count once, however many choices it has (as colocated).
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
    assert fakes.posts.count("prefill") == fakes.posts.count("decode") == 4


def test_cached_prompt_tokens_count_once_per_prompt_like_its_prompt_tokens():
    async def decode(body):
        answer = _completion(body)
        # as a worker reports it: the prompt's length in tokens served from the cache
        answer["usage"]["prompt_tokens_details"] = {"cached_tokens": len(body["prompt"]) - 1}
        return httpx.Response(200, json=answer)

    fakes = FakeWorkers(decode=decode)
    body = {"prompt": ["aaaa", "bb"], "n": 3, "max_tokens": 2}
    with _router(fakes) as client:
        answer = client.post("/v1/completions", json=body).json()
    assert answer["usage"]["prompt_tokens"] == 6
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 3 + 1}


def test_merged_streams_share_one_id_renumber_choices_and_end_once():
    fakes = FakeWorkers(decode=_decode)
    body = {
        "prompt": ["a", "bb", "ccc"],
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": 1,
    }
    with _router(fakes) as client, client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert len({e["id"] for e in events}) == 1
    *chunks, usage = events
    texts = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "a|1", 1: "bb|1", 2: "ccc|1"}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["prompt_tokens"] == 6


def test_a_generate_batch_answers_a_list_streamed_with_indexes():
    async def decode(body):
        result = {"text": str(body["input_ids"]), "output_ids": [1], "meta_info": {}}
        if body.get("stream"):
            return httpx.Response(200, content=_sse({**result, "index": 0}))
        return httpx.Response(200, json=result)

    fakes = FakeWorkers(decode=decode)
    body = {"input_ids": [[5], [6, 7]], "sampling_params": {"max_new_tokens": 1}}
    with _router(fakes) as client:
        answer = client.post("/generate", json=body).json()
        assert [r["text"] for r in answer] == ["[5]", "[6, 7]"]
        with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert sorted((e["index"], e["text"]) for e in events) == [(0, "[5]"), (1, "[6, 7]")]


# ---- a room that fails ------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_one_room_failing_for_good_fails_the_request_and_ends_every_other_room(stream):
    """Room "bad" is refused (a client error: not retried); the other rooms' decode legs
    wait for their transfers: every one of them is cancelled, and the rooms that never
    reached a worker are aborted by room."""

    async def prefill(body):
        if body["prompt"] == "bad":
            return worker_error(400, "prompt: bad is not a prompt", "invalid_request_error")
        await asyncio.Event().wait()  # NOTE: only a cancellation ends it

    async def decode(body):
        await asyncio.Event().wait()

    fakes = FakeWorkers(prefill=prefill, decode=decode)
    body = {"prompt": ["fine", "bad", "also fine"], "stream": stream}
    with _router(fakes) as client:
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "prompt: bad is not a prompt"
        workers = client.get("/workers").json()
        assert [w["in_flight"] for role in workers.values() for w in role] == [0, 0]
    cut = fakes.cancelled + [role for role, _ in fakes.aborted_rooms]
    # The two good rooms lose both legs (cancelled, or aborted by room if never sent), and
    # the bad room its decode leg.
    assert cut.count("prefill") >= 2 and cut.count("decode") >= 3


def test_a_room_that_fails_mid_stream_ends_the_merged_stream_with_its_error():
    async def decode(body):
        answer = _completion(body)
        if body["prompt"] == "dies":
            error = {"message": "transfer failed", "type": "server_error", "code": None}
            return httpx.Response(200, content=_sse(answer, {"error": error}))
        return httpx.Response(200, content=_sse(answer))

    fakes = FakeWorkers(decode=decode)
    body = {"prompt": ["dies", "lives"], "stream": True}
    with _router(fakes) as client, client.stream("POST", "/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["message"] == "transfer failed"


def test_rooms_that_would_multiply_a_large_body_are_refused_with_413():
    body = {"prompt": "x" * 1000, "n": 100}
    with pytest.raises(TooManyParts, match="over 50000 bytes") as e:
        split("/v1/completions", body, limit=256, max_bytes=50_000)
    assert e.value.status == 413
    junk = {"prompt": ["a", "b", "c"], "unused": "y" * 1000}
    with pytest.raises(TooManyParts):
        split("/v1/completions", junk, limit=256, max_bytes=2500)
    assert len(split("/v1/completions", junk, limit=256, max_bytes=4000)) == 3


def test_a_room_whose_stream_ends_without_done_fails_the_merged_stream_at_once():
    async def decode(body):
        events = _sse(_completion(body))
        if body["prompt"] == "cut":
            events = events.removesuffix(b"data: [DONE]\n\n")
        return httpx.Response(200, content=events)

    fakes = FakeWorkers(decode=decode)
    body = {"prompt": ["cut", "whole"], "stream": True}
    # NOTE: the request deadline is far away: only noticing the end of the stream ends it.
    router = _router(fakes, request_timeout_s=600)
    with router as client, client.stream("POST", "/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert "without [DONE]" in json.loads(lines[-2][6:])["error"]["message"]


def test_too_many_rooms_is_a_400_before_any_worker_is_asked():
    fakes = FakeWorkers(decode=_decode)
    with _router(fakes, max_rooms_per_request=4) as client:
        response = client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"
    assert "--max-rooms-per-request" in response.json()["error"]["message"]
    assert fakes.posts == []


# ---- client errors are not worker failures ---------------------------------------------


def test_a_client_error_is_counted_by_status_not_as_a_leg_failure(caplog):
    async def invalid(body):
        return worker_error(400, "max_tokens: must be an integer", "invalid_request_error")

    fakes = FakeWorkers(prefill=invalid, decode=invalid)
    with caplog.at_level(logging.INFO, logger="pdserve.router"), _router(fakes) as client:
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 400
        metrics = client.get("/metrics").text
    assert 'requests_total{endpoint="/v1/completions",status="400"} 1.0' in metrics
    assert "leg_failures_total{" not in metrics
    leg_lines = [r for r in caplog.records if "max_tokens" in r.getMessage()]
    assert leg_lines and all(r.levelno == logging.INFO for r in leg_lines)
