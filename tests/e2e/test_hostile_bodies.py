"""Bodies that used to kill a worker's engine or answer 500 now get a 400 naming the problem
(or, for a tiny temperature, a normal completion); the engine stays up and keeps serving."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from pdserve.edge.strict_json import MAX_BODY_BYTES
from pdserve.server.generation import MAX_PROMPT_CHARS_PER_TOKEN
from tests.waiting import wait_until

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENGINE_KILLERS = [
    ({"min_tokens": 1, "stop_token_ids": [5000]}, "stop_token_ids"),
    ({"min_tokens": 1, "stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"temperature": 1, "top_p": 0.9, "top_k": 2**63}, "top_k"),
    ({"temperature": 1, "repetition_penalty": 1e-40}, "repetition_penalty"),
    ({"temperature": 1e-40}, None),  # valid: sampled at the temperature floor
]


def assert_serving(server) -> None:
    assert server.get("/health").status_code == 200
    after = server.post(COMPLETIONS, {"prompt": "hello", "max_tokens": 3, "temperature": 0})
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["finish_reason"] in ("length", "stop")


def assert_openai_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"] and len(error["message"]) < 400
    if param is not None:
        assert param in (error["param"] or "") or param in error["message"], error
    return error


@pytest.mark.parametrize(
    ("fields", "param"), ENGINE_KILLERS, ids=[p or "tiny" for _, p in ENGINE_KILLERS]
)
def test_engine_killers_on_completions(server, fields, param):
    response = server.post(COMPLETIONS, {"prompt": "hello", "max_tokens": 4, **fields})
    if param is None:
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"][0]["text"]) > 0
    else:
        assert_openai_error(response, 400, param)
    assert_serving(server)


@pytest.mark.parametrize(
    ("fields", "param"), ENGINE_KILLERS, ids=[p or "tiny" for _, p in ENGINE_KILLERS]
)
def test_engine_killers_on_generate(server, fields, param):
    sampling = {"max_new_tokens": 4, **fields}
    if "min_tokens" in sampling:
        sampling["min_new_tokens"] = sampling.pop("min_tokens")
    response = server.post("/generate", {"text": "hello", "sampling_params": sampling})
    if param is None:
        assert response.status_code == 200, response.text
    else:
        assert_openai_error(response, 400, param)
    assert_serving(server)


def post_raw(server, path: str, content: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=30)


RAW_BODIES = [
    ("NaN", b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', "NaN"),
    ("Infinity", b'{"prompt": "hi", "max_tokens": 2, "top_p": -Infinity}', "Infinity"),
    ("surrogate", b'{"prompt": "hi \\ud800 there", "max_tokens": 2}', "surrogate"),
    ("surrogate in model", b'{"prompt": "hi", "model": "\\udfff"}', "surrogate"),
    ("deep nesting", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
    ("moderate nesting", b'{"prompt": "hi", "user": ' + b"[" * 500 + b"]" * 500 + b"}", "nested"),
    ("huge integer", b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", "digits"),
]


@pytest.mark.parametrize(("case", "content", "word"), RAW_BODIES, ids=[b[0] for b in RAW_BODIES])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, "/generate"])
def test_json_edge_cases_are_400(server, case, content, word, path):
    error = assert_openai_error(post_raw(server, path, content), 400, None)
    assert word in error["message"], error
    assert server.get("/health").status_code == 200


GENERATE_WRONG_TYPES = [
    ({"text": "hi", "sampling_params": {"max_new_tokens": "x"}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"temperature": [1]}}, "temperature"),
    ({"text": "hi", "sampling_params": {"stop": 5}}, "stop"),
    ({"text": "hi", "sampling_params": {"stop_token_ids": ["a"]}}, "stop_token_ids"),
    ({"text": "hi", "sampling_params": {"ignore_eos": "yes"}}, "ignore_eos"),
    ({"text": "hi", "sampling_params": {"seed": 2**64}}, "seed"),
    ({"text": "hi", "sampling_params": {"stop": ["x"] * 1000}}, "stop"),
    ({"text": "hi", "sampling_params": "greedy"}, "sampling_params"),
    ({"text": 5}, "text"),
    ({"input_ids": "abc"}, "input_ids"),
    ({"input_ids": [[1, 2], "x"]}, "input_ids"),
    ({"text": "hi", "rid": 7}, "rid"),
    ({"text": "hi", "rid": "r" * 1000}, "rid"),
]


@pytest.mark.parametrize(
    ("body", "param"), GENERATE_WRONG_TYPES, ids=[p for _, p in GENERATE_WRONG_TYPES]
)
def test_generate_wrong_types_are_400(server, body, param):
    assert_openai_error(server.post("/generate", body), 400, param)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_seed_beyond_64_bits_is_400_naming_seed(server, path):
    body = {"max_tokens": 2, "seed": 2**64}
    body.update(
        {"prompt": "hi"}
        if path == COMPLETIONS
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    assert_openai_error(server.post(path, body), 400, "seed")
    body["seed"] = 2**63 - 1
    body["n"] = 2  # the second choice's seed wraps around instead of overflowing
    assert server.post(path, body).status_code == 200


def test_duplicate_rid_in_flight_is_400_naming_rid(server):
    long = {"input_ids": [5] * 8, "rid": "dup-rid", "stream": True}
    long["sampling_params"] = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/generate", json=long, timeout=60) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # NOTE: kept: dropping it would close the stream
        event = next(line for line in lines if line.startswith("data:"))
        assert '"finish_reason": null' in event, event
        second = server.post("/generate", {"text": "hi", "rid": "dup-rid"})
        assert_openai_error(second, 400, "rid")
    wait_until(lambda: server.metric("kv_cache_pages_used") == 0, "the abort to free pages")
    assert server.post("/generate", {"text": "hi", "rid": "dup-rid"}).status_code == 200


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1])


def test_a_10mb_prompt_is_refused_before_tokenizing(server):
    limit = MAX_PROMPT_CHARS_PER_TOKEN * 512
    before = _rss_kb(server.process.pid)
    huge = "lorem ipsum " * (10_000_000 // 12)
    started = time.monotonic()
    for path, body in [
        (COMPLETIONS, {"prompt": huge}),
        (COMPLETIONS, {"prompt": ["hi", huge]}),
        (CHAT, {"messages": [{"role": "user", "content": huge}]}),
        ("/generate", {"text": huge}),
    ]:
        error = assert_openai_error(server.post(path, body), 400, None)
        assert f"limit of {limit} characters" in error["message"], error
    assert time.monotonic() - started < 30  # tokenizing even one of them took 18-30 s
    assert _rss_kb(server.process.pid) - before < 200_000
    assert_serving(server)


def test_a_body_over_the_size_limit_is_413_before_it_is_read(server):
    before = _rss_kb(server.process.pid)
    body = b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
    response = post_raw(server, COMPLETIONS, body)
    error = assert_openai_error(response, 413, None)
    assert (error["type"], error["code"]) == ("invalid_request_error", "body_too_large")
    assert _rss_kb(server.process.pid) - before < 200_000
    assert_serving(server)


def test_too_many_prompts_or_messages_are_refused_before_tokenizing(server):
    prompts = {"prompt": ["hi"] * 2000, "max_tokens": 1}
    assert_openai_error(server.post(COMPLETIONS, prompts), 400, "prompt")
    messages = {"messages": [{"role": "user", "content": ""}] * 600, "max_tokens": 1}
    assert_openai_error(server.post(CHAT, messages), 400, "messages")


def test_many_stop_strings_are_refused(server):
    body = {"prompt": "hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(10_000)]}
    assert_openai_error(server.post(COMPLETIONS, body), 400, "stop")


def test_hostile_bodies_in_parallel_leave_the_engine_serving(server):
    bodies = [{"prompt": "hello", "max_tokens": 4, **fields} for fields, _ in ENGINE_KILLERS]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        statuses = list(pool.map(lambda b: server.post(COMPLETIONS, b).status_code, bodies))
    assert sorted(statuses) == [200, 400, 400, 400, 400]
    assert_serving(server)
