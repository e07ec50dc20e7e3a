"""vLLM's habits on a worker: `--chat-template` (a file) replaces the tokenizer's template, a
request's `chat_template_kwargs` reach it, and /tokenize and /detokenize answer in vLLM's
shapes. The expected token ids are the tokenizer's own encoding of the text the template
must render, written out here."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.e2e.conftest import start_server, stop_server

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if enable_thinking %}<think>\n{% endif %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def templated(tiny_model_dirs, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "template.jinja"
    path.write_text(TEMPLATE)
    model = tiny_model_dirs("llama")
    server = start_server(model, "--max-model-len", "256", "--chat-template", str(path))
    yield server, AutoTokenizer.from_pretrained(model)
    stop_server(server)


def test_tokenize_a_prompt(templated):
    server, tokenizer = templated
    reply = server.post("/tokenize", {"prompt": "once upon a time", "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    expected = tokenizer.encode("once upon a time")
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == 256
    assert "".join(body["token_strs"]) == "once upon a time"


def test_chat_template_file_and_its_kwargs(templated):
    server, tokenizer = templated
    plain = tokenizer.encode("[user] hello there\n[assistant] ", add_special_tokens=False)
    thinking = tokenizer.encode(
        "[user] hello there\n<think>\n[assistant] ", add_special_tokens=False
    )
    for kwargs, expected in [(None, plain), ({"enable_thinking": True}, thinking)]:
        reply = server.post("/tokenize", {"messages": USER, "chat_template_kwargs": kwargs})
        assert reply.status_code == 200, reply.text
        assert reply.json()["tokens"] == expected
        chat = {"messages": USER, "max_tokens": 1, "chat_template_kwargs": kwargs}
        answer = server.post("/v1/chat/completions", chat)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens"] == len(expected)


def test_template_kwargs_cannot_override_the_templates_own_arguments(templated):
    server, _ = templated
    chat = {"messages": USER, "max_tokens": 1, "chat_template_kwargs": {"tokenize": True}}
    reply = server.post("/v1/chat/completions", chat)
    assert reply.status_code == 400, reply.text
    assert "chat_template_kwargs cannot set tokenize" in reply.json()["error"]["message"]


def test_detokenize(templated):
    server, tokenizer = templated
    ids = tokenizer.encode("the quick brown fox")
    reply = server.post("/detokenize", {"tokens": ids})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"prompt": "the quick brown fox"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [1] * 257}, "tokens"),
        ("/tokenize", {"prompt": "x" * 100_000}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": USER}, None),
    ],
)
def test_tokenizer_endpoints_refuse_what_they_cannot_take(templated, path, body, param):
    server, _ = templated
    reply = server.post(path, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
