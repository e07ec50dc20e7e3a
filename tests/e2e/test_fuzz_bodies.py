"""No request body crashes the worker: seeded random JSON to every POST endpoint."""

from __future__ import annotations

import json
import random

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")
KEYS = (
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "stream",
    "text",
    "input_ids",
    "sampling_params",
    "top_k",
    "min_p",
    "ignore_eos",
    "model",
    "stop_token_ids",
    "min_tokens",
)


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 6)
    if kind == 0:
        return rng.randint(-(10**12), 10**12)
    if kind == 1:
        return rng.choice([0, 1, -1, 2, 4, 16])
    if kind == 2:
        return rng.uniform(-5, 5)
    if kind == 3:
        return rng.choice(["", "hi", "\x00", "ü" * 3, "a" * 50])
    if kind == 4:
        return rng.choice([True, False, None])
    if kind == 5:
        return [rng.randint(-3, 2000) for _ in range(rng.randrange(5))]
    if kind == 6:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    if kind == 7:
        return {"role": rng.choice(["user", "x"]), "content": random_value(rng, depth + 1)}
    return {k: random_value(rng, depth + 1) for k in rng.sample(KEYS, rng.randrange(3))}


def test_random_bodies_never_crash_the_worker(server):
    rng = random.Random(1234)
    statuses = set()
    for _ in range(150):
        body = {k: random_value(rng) for k in rng.sample(KEYS, rng.randrange(1, 6))}
        if body.get("stream") is True:
            body["stream"] = False
        response = server.post(rng.choice(PATHS), body)
        statuses.add(response.status_code)
        assert response.status_code < 500, (body, response.text)
        if response.status_code >= 400:
            assert "message" in response.json()["error"]
    assert server.get("/health").status_code == 200
    assert statuses & {400, 404}


# ---- property-based: bodies shaped like real ones, values at and beyond every bound --------

HOSTILE_NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-40, 5e-324, 1e308, -0.0, 1e-5, 1e4]),
)
HOSTILE_TEXT = st.one_of(
    st.text(max_size=20),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=3),
    st.sampled_from(["", "\x00", "hi"]),
)
LEAVES = st.one_of(HOSTILE_NUMBERS, HOSTILE_TEXT, st.booleans(), st.none())
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(HOSTILE_TEXT, inner, max_size=3)
    ),
    max_leaves=12,
)
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "logprobs",
    "n",
)
SAMPLING = st.dictionaries(st.sampled_from(SAMPLING_KEYS), VALUES, max_size=4)


@st.composite
def hostile_request(draw):
    path = draw(st.sampled_from(PATHS))
    sampling = draw(SAMPLING)
    if path == "/generate":
        sampling.pop("n", None)
        sampling.pop("logprobs", None)
        if "min_tokens" in sampling:
            sampling["min_new_tokens"] = sampling.pop("min_tokens")
        sampling.setdefault("max_new_tokens", 4)
        prompt_key = draw(st.sampled_from(["text", "input_ids"]))
        prompt = draw(st.one_of(HOSTILE_TEXT, st.lists(HOSTILE_NUMBERS, max_size=4), VALUES))
        body = {prompt_key: prompt, "sampling_params": sampling}
        body.update(draw(st.dictionaries(st.sampled_from(["rid", "return_logprob"]), VALUES)))
        return path, body
    body = {**sampling, "max_tokens": draw(st.one_of(st.just(4), HOSTILE_NUMBERS))}
    if path == "/v1/completions":
        body["prompt"] = draw(
            st.one_of(HOSTILE_TEXT, st.lists(HOSTILE_NUMBERS, max_size=4), VALUES)
        )
    else:
        content = draw(st.one_of(HOSTILE_TEXT, VALUES))
        body["messages"] = [
            {"role": draw(st.sampled_from(["user", "system", "x"])), "content": content}
        ]
    return path, body


@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(hostile_request())
def test_hostile_bodies_never_5xx(server, case):
    path, body = case
    # NOTE: serialized here: NaN/Infinity literals and lone surrogates must reach the server.
    content = json.dumps(body).encode()
    response = httpx.post(
        server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60
    )
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["message"]


def test_the_engine_survived_the_fuzzing(server):
    assert server.get("/health").status_code == 200
    body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
    assert server.post("/v1/completions", body).status_code == 200
