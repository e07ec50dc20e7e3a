"""Bad requests get OpenAI-shaped errors with the right status; the server stays healthy."""

from __future__ import annotations

import httpx
import pytest

from pdserve.server.openai_protocol import UNSUPPORTED
from tests.e2e.conftest import start_server, stop_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
USER = [{"role": "user", "content": "hi"}]
MINIMAL = {
    COMPLETIONS: {"prompt": "hello", "max_tokens": 2},
    CHAT: {"messages": USER, "max_tokens": 2},
    GENERATE: {"text": "hello", "sampling_params": {"max_new_tokens": 2}},
}


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
    ("user turn without content", CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0]"),
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
    """Streams held open stay in flight (1 running, 2 waiting); the next request is refused.
    A stream's 200 comes after admission, so each open stream is counted before the next
    one asks. The running count the server compares with may lag a step, so the refusal
    comes at the third stream or the fourth, never later."""
    import contextlib

    headers = {"Authorization": "Bearer s3cret"}
    body = body_with(
        guarded.model_path, max_tokens=2000, ignore_eos=True, prompt=[5] * 20, stream=True
    )
    statuses = []
    with httpx.Client(timeout=60) as client, contextlib.ExitStack() as open_streams:
        for _ in range(4):
            response = open_streams.enter_context(
                client.stream("POST", guarded.url + COMPLETIONS, json=body, headers=headers)
            )
            statuses.append(response.status_code)
            if response.status_code == 429:
                assert response.read() and response.json()["error"]["code"] == "rate_limit_exceeded"
                break
    # NOTE: leaving the block closed the streams: the server aborts those requests.
    assert statuses[:2] == [200, 200] and statuses[-1] == 429 and len(statuses) >= 3, statuses
    assert guarded.get("/health").status_code == 200


def assert_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    return error


# A string, a bool or a float where an integer belongs; a string or a bool where a number
# belongs; a string or an integer where a boolean belongs. OpenAI's API is typed.
TYPE_CONFUSIONS = [
    (COMPLETIONS, {"max_tokens": "4"}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": True}, "max_tokens"),  # it used to be 1 token
    (COMPLETIONS, {"max_tokens": 4.0}, "max_tokens"),
    (CHAT, {"max_tokens": "4"}, "max_tokens"),
    (CHAT, {"max_completion_tokens": True}, "max_completion_tokens"),
    (COMPLETIONS, {"n": "2"}, "n"),
    (CHAT, {"n": 2.0}, "n"),
    (COMPLETIONS, {"temperature": "0.5"}, "temperature"),
    (CHAT, {"temperature": True}, "temperature"),
    (COMPLETIONS, {"top_k": "5"}, "top_k"),
    (COMPLETIONS, {"stream": "true"}, "stream"),
    (CHAT, {"stream": 1}, "stream"),
    (CHAT, {"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    (COMPLETIONS, {"seed": "1"}, "seed"),
    (CHAT, {"seed": True}, "seed"),
    (CHAT, {"logprobs": "yes"}, "logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
    (COMPLETIONS, {"logprobs": True}, "logprobs"),
    (COMPLETIONS, {"ignore_eos": 1}, "ignore_eos"),
    (GENERATE, {"sampling_params": {"max_new_tokens": "4"}}, "max_new_tokens"),
    (GENERATE, {"sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
    (GENERATE, {"sampling_params": {"max_new_tokens": 4.0}}, "max_new_tokens"),
    (GENERATE, {"sampling_params": {"max_new_tokens": 2, "temperature": True}}, "temperature"),
    (GENERATE, {"sampling_params": {"max_new_tokens": 2, "ignore_eos": 1}}, "ignore_eos"),
    (GENERATE, {"return_logprob": True, "top_logprobs_num": "2"}, "top_logprobs_num"),
    (GENERATE, {"return_logprob": "yes"}, "return_logprob"),
    (GENERATE, {"stream": 1}, "stream"),
]


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    TYPE_CONFUSIONS,
    ids=[f"{path}-{fields}" for path, fields, _ in TYPE_CONFUSIONS],
)
def test_a_value_of_the_wrong_type_is_400_naming_the_field(server, path, fields, param):
    error = assert_error(server.post(path, {**MINIMAL[path], **fields}), 400, param)
    assert error["type"] == "invalid_request_error"


def test_an_integer_is_a_number(server):
    for path, fields in [
        (COMPLETIONS, {"temperature": 1, "top_p": 1, "presence_penalty": 0}),
        (CHAT, {"temperature": 0, "repetition_penalty": 1}),
        (GENERATE, {"sampling_params": {"max_new_tokens": 2, "temperature": 0, "top_p": 1}}),
    ]:
        response = server.post(path, {**MINIMAL[path], **fields})
        assert response.status_code == 200, response.text


UNSUPPORTED_FIELDS = [
    (CHAT, "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    (CHAT, "tool_choice", "auto"),
    (CHAT, "functions", [{"name": "f", "parameters": {}}]),
    (CHAT, "function_call", {"name": "f"}),
    (CHAT, "response_format", {"type": "json_object"}),
    (CHAT, "logit_bias", {"50": -100}),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "prediction", {"type": "content", "content": "hello"}),
    (CHAT, "web_search_options", {}),
    (COMPLETIONS, "echo", True),
    (COMPLETIONS, "suffix", " the end"),
    (COMPLETIONS, "logit_bias", {"50": 5}),
    (COMPLETIONS, "best_of", 3),
    (CHAT, "parallel_tool_calls", False),
    (CHAT, "reasoning_effort", "low"),
    (CHAT, "chat_template", "{{ messages }}"),
    (CHAT, "continue_final_message", True),
    (CHAT, "echo", True),
    (CHAT, "add_special_tokens", True),
    (COMPLETIONS, "add_special_tokens", False),
    (CHAT, "documents", [{"title": "t", "text": "the answer is 4"}]),
]
# vLLM's and SGLang's own extensions, refused on both endpoints.
EXTENSION_VALUES = {
    "guided_json": {"type": "object"},
    "guided_regex": "[a-z]+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": 'root ::= "a"',
    "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ",
    "structured_outputs": {"choice": ["yes", "no"]},
    "structural_tag": "{}",
    "json_schema": '{"type": "object"}',
    "regex": "[0-9]+",
    "ebnf": 'root ::= "a"',
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
    "logits_processors": ["some.module:Processor"],
    "allowed_token_ids": [1, 2],
    "bad_words": ["bad"],
    "prompt_logprobs": 1,
    "use_beam_search": True,
    "truncate_prompt_tokens": 8,
    "spaces_between_special_tokens": False,
    "return_tokens_as_token_ids": True,
    "priority": 1,
    "lora_path": "adapter",
    "no_stop_trim": True,
    "return_hidden_states": True,
    "cache_salt": "tenant-a",
}
UNSUPPORTED_FIELDS += [
    (path, field, value)
    for path in (CHAT, COMPLETIONS)
    for field, value in EXTENSION_VALUES.items()
]


@pytest.mark.parametrize(
    ("path", "field", "value"),
    UNSUPPORTED_FIELDS,
    ids=[f"{path}-{field}" for path, field, _ in UNSUPPORTED_FIELDS],
)
def test_an_unsupported_field_is_400_naming_it(server, path, field, value):
    error = assert_error(server.post(path, {**MINIMAL[path], field: value}), 400, field)
    assert f"{field} is not supported" in error["message"], error


@pytest.mark.parametrize("key", ["regex", "json_schema", "ebnf", "structural_tag"])
def test_sglang_constrained_decoding_keys_are_400_naming_them(server, key):
    sampling = {"max_new_tokens": 2, key: "x"}
    response = server.post(GENERATE, {"text": "hi", "sampling_params": sampling})
    error = assert_error(response, 400, f"sampling_params.{key}")
    assert f"sampling_params.{key} is not supported" in error["message"], error


def test_every_unsupported_field_is_tested():
    endpoints = {CHAT: "chat", COMPLETIONS: "completions"}
    tested = {(endpoints[path], field) for path, field, _ in UNSUPPORTED_FIELDS}
    assert tested == {(e, f) for e, fields in UNSUPPORTED.items() for f in fields}


def test_unsupported_fields_that_ask_for_nothing_and_unknown_fields_are_accepted(server):
    not_used = {
        CHAT: {
            "tools": [],
            "tool_choice": "none",
            "functions": None,
            "response_format": {"type": "text"},
            "logit_bias": {},
            "modalities": ["text"],
            "add_special_tokens": False,
            "spaces_between_special_tokens": True,
            "priority": 0,
            "some_extension": {"x": 1},
        },
        COMPLETIONS: {
            "echo": False,
            "suffix": "",
            "logit_bias": None,
            "best_of": 2,
            "n": 2,
            "add_special_tokens": True,
            "some_extension": 1,
        },
    }
    for path, fields in not_used.items():
        response = server.post(path, {**MINIMAL[path], **fields})
        assert response.status_code == 200, response.text


def test_unknown_paths_and_wrong_methods_have_openai_errors(server):
    missing = server.get("/v1/nowhere")
    error = assert_error(missing, 404, None)
    assert error["code"] == "not_found" and "/v1/nowhere" in error["message"]
    for response, allowed in [
        (server.get(COMPLETIONS), "POST"),
        (server.get(GENERATE), "POST"),
        (server.post("/v1/models", {}), "GET"),
    ]:
        error = assert_error(response, 405, None)
        assert error["code"] == "method_not_allowed"
        assert error["type"] == "invalid_request_error"
        assert response.headers["allow"] == allowed
        assert allowed in error["message"]
