"""Bad requests get OpenAI-shaped errors with the right status; the server stays healthy."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import start_server, stop_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def body_with(served_model, **fields):
    return {"model": served_model, "prompt": "hello", "max_tokens": 4, **fields}


CASES = [
    ("max_tokens wrong type", COMPLETIONS, {"max_tokens": "many"}, 400, "max_tokens"),
    ("negative max_tokens", COMPLETIONS, {"max_tokens": -3}, 400, "max_tokens"),
    ("temperature < 0", COMPLETIONS, {"temperature": -0.5}, 400, "temperature"),
    ("top_p > 1", COMPLETIONS, {"top_p": 1.5}, 400, "top_p"),
    ("top_k < -1", COMPLETIONS, {"top_k": -7}, 400, "top_k"),
    ("n too large", COMPLETIONS, {"n": 1000}, 400, "n"),
    ("negative stop token id", COMPLETIONS, {"stop_token_ids": [-5]}, 400, "stop_token_ids"),
    ("prompt wrong type", COMPLETIONS, {"prompt": {"a": 1}}, 400, "prompt"),
    ("token id outside vocab", COMPLETIONS, {"prompt": [1, 10**9]}, 400, "prompt"),
    ("oversize prompt", COMPLETIONS, {"prompt": [5] * 600}, 400, "prompt"),
    (
        "prompt + max_tokens too long",
        COMPLETIONS,
        {"prompt": [5] * 500, "max_tokens": 100},
        400,
        "max_tokens",
    ),
    ("unknown model", COMPLETIONS, {"model": "gpt-17"}, 404, "model"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    (
        "top_logprobs without logprobs",
        CHAT,
        {"messages": USER, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
]


@pytest.mark.parametrize(
    ("case", "path", "fields", "status", "param"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_request(server, case, path, fields, status, param):
    body = body_with(server.model_path, **fields)
    if path == CHAT:
        body.pop("prompt")
        body.setdefault("messages", USER)
    response = server.post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert param in (error["param"] or "") or param in error["message"]
    assert server.get("/health").status_code == 200


def test_invalid_json_is_400(server):
    response = httpx.post(
        server.url + COMPLETIONS,
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert server.get("/health").status_code == 200


@pytest.fixture(scope="module")
def guarded(tiny_model_dirs):
    server = start_server(
        tiny_model_dirs("llama"),
        "--api-key",
        "s3cret",
        "--max-queued-requests",
        "2",
        "--max-running-requests",
        "1",
    )
    yield server
    stop_server(server)


def test_api_key_required_except_health_and_metrics(guarded):
    body = body_with(guarded.model_path)
    assert guarded.post(COMPLETIONS, body).status_code == 401
    wrong = guarded.post(COMPLETIONS, body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    right = guarded.post(COMPLETIONS, body, headers={"Authorization": "Bearer s3cret"})
    assert right.status_code == 200
    assert guarded.get("/health").status_code == 200
    assert guarded.get("/metrics").status_code == 200
    assert guarded.get("/health_generate").status_code == 200  # the readiness probe
    assert guarded.get("/server_info").status_code == 401


def test_full_waiting_queue_answers_429(guarded):
    import concurrent.futures

    headers = {"Authorization": "Bearer s3cret"}
    body = body_with(guarded.model_path, max_tokens=400, ignore_eos=True, prompt=[5] * 20)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = list(
            pool.map(
                lambda _: guarded.post(COMPLETIONS, body, headers=headers).status_code, range(8)
            )
        )
    assert 429 in statuses and 200 in statuses, statuses
    assert set(statuses) <= {200, 429}
    assert guarded.get("/health").status_code == 200
