"""No request body crashes the worker: seeded random JSON to every POST endpoint."""

from __future__ import annotations

import random

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
