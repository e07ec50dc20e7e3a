"""No request body crashes the worker: seeded random JSON to every POST endpoint, bodies shaped
like real ones with values at and beyond every bound, and bodies drawn from the worker's own
OpenAPI schema (every declared field, of its type or of another)."""

from __future__ import annotations

import json
import random

import httpx
import pytest
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


# ---- from the OpenAPI schema: every field the API declares ------------------------------

# NOTE: sizes that only cost time (hostile values for them are drawn above) stay small here.
CAPPED = {"max_tokens": 8, "max_new_tokens": 8, "n": 2, "top_logprobs": 3}


def from_schema(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    """Values of the schema's type, or (one time in several) anything at all."""
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[1]], components, depth)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, components, depth) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        typed = st.integers(
            min_value=int(low) if low is not None else None,
            max_value=int(high) if high is not None else None,
        )
        return st.one_of(typed, HOSTILE_NUMBERS)
    if kind == "number":
        return HOSTILE_NUMBERS
    if kind == "string":
        return st.one_of(HOSTILE_TEXT, st.sampled_from(schema.get("enum", ["user"])))
    if kind == "boolean":
        return st.one_of(st.booleans(), VALUES)
    if kind == "array":
        items = from_schema(schema.get("items", {}), components, depth + 1)
        return st.one_of(st.lists(items, max_size=4), VALUES)
    if kind == "object" and "properties" in schema and depth < 4:
        fields = {
            name: from_schema(sub, components, depth + 1)
            for name, sub in schema["properties"].items()
        }
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        )
    return VALUES


def _capped(body):
    if isinstance(body, dict):
        for key, limit in CAPPED.items():
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > limit:
                body[key] = limit
        for value in body.values():
            _capped(value)
    return body


@pytest.fixture(scope="module")
def schema_bodies(server):
    spec = server.get("/openapi.json").json()
    components = spec["components"]["schemas"]
    strategies = []
    for path in PATHS:
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        strategies.append(st.tuples(st.just(path), from_schema(ref, components)))
    return st.one_of(strategies)


@settings(max_examples=90, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_bodies_from_the_openapi_schema_never_5xx(server, schema_bodies, data):
    path, body = data.draw(schema_bodies)
    body = _capped(body)
    content = json.dumps(body).encode()
    response = httpx.post(
        server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60
    )
    assert response.status_code < 500, (path, body, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["message"]


def test_the_engine_survived_the_fuzzing(server):
    assert server.get("/health").status_code == 200
    body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
    assert server.post("/v1/completions", body).status_code == 200
