"""SGLang's native API and the worker's health and metrics endpoints."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from pdserve import LLM, SamplingParams
from pdserve.engine.text.detokenizer import decode_text

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer(server):
    return AutoTokenizer.from_pretrained(server.model_path)


def stream_events(server, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=30) as response:
        return [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")
        ]


def test_generate_text(server, tokenizer):
    out = server.post("/generate", {"text": "Hello", "sampling_params": GREEDY}).json()
    assert len(out["output_ids"]) == 12
    # The engine sends ids only; the front end's text is what a whole decode of them reads.
    assert out["text"] == decode_text(tokenizer, out["output_ids"])
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["completion_tokens"] == 12 and meta["prompt_tokens"] > 0


def test_generate_input_ids_equal_offline_llm(server):
    prompts = [[11, 22, 33], [44] * 50]
    out = server.post("/generate", {"input_ids": prompts, "sampling_params": GREEDY}).json()
    offline = LLM(server.model_path, device="cpu", max_model_len=512).generate(
        prompts, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    )
    assert [o["output_ids"] for o in out] == [o.token_ids for o in offline]
    assert [o["text"] for o in out] == [o.text for o in offline]


def test_generate_stream_is_cumulative(server):
    events = stream_events(server, {"text": "Stream me", "sampling_params": GREEDY, "stream": True})
    lengths = [len(e["output_ids"]) for e in events]
    assert lengths == sorted(lengths) and lengths[-1] == 12
    whole = server.post("/generate", {"text": "Stream me", "sampling_params": GREEDY}).json()
    assert events[-1]["text"] == whole["text"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_stop_string_reports_match(server):
    full = server.post("/generate", {"text": "Hi", "sampling_params": GREEDY}).json()["text"]
    stop = full[3:6]
    params = {**GREEDY, "stop": stop}
    out = server.post("/generate", {"text": "Hi", "sampling_params": params}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[: full.index(stop)]


def test_stop_string_across_tokens_cuts_the_stream_where_the_engine_stopped(server, tokenizer):
    """The engine stops on the token that completes the stop string; the front end, fed the
    same tokens, cuts the text where it begins, and no event shows any of it."""
    prompt, params = [3, 141, 59, 26], {**GREEDY, "max_new_tokens": 32}
    out = server.post("/generate", {"input_ids": prompt, "sampling_params": params}).json()
    ids = out["output_ids"]
    pieces = [decode_text(tokenizer, [t]) for t in ids]

    def letter(c: str) -> bool:
        return c.isascii() and c.isalnum()

    # From the last character of one token into the next (ASCII: no character is split).
    cut = next(
        i
        for i in range(1, len(ids) - 1)
        if letter(pieces[i][-1:]) and letter(pieces[i + 1][:1]) and pieces[i + 1].isascii()
    )
    stop = pieces[cut][-1] + pieces[cut + 1][:2]
    full = decode_text(tokenizer, ids)
    stop_at = next(n for n in range(1, len(ids) + 1) if stop in decode_text(tokenizer, ids[:n]))
    body = {"input_ids": prompt, "sampling_params": {**params, "stop": stop}, "stream": True}
    events = stream_events(server, body)
    final = events[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert final["output_ids"] == ids[:stop_at]
    assert final["text"] == full[: full.index(stop)]
    assert all(final["text"].startswith(e["text"]) for e in events)


def test_generate_logprobs(server):
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": GREEDY,
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    meta = server.post("/generate", body).json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == 12
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])


def test_generate_needs_text_or_input_ids(server):
    response = server.post("/generate", {"sampling_params": GREEDY})
    assert response.status_code == 400 and response.json()["error"]["param"] == "text"


def test_model_and_server_info(server):
    for path in ("/get_model_info", "/model_info"):
        info = server.get(path).json()
        assert info["model_path"] == server.model_path and info["is_generation"] is True
    for path in ("/get_server_info", "/server_info"):
        info = server.get(path).json()
        assert info["max_model_len"] == 512 and info["max_total_num_tokens"] > 0
        assert info["port"] == int(server.url.rsplit(":", 1)[1])


def test_health_and_health_generate(server):
    assert server.get("/health").status_code == 200
    assert server.get("/health_generate").status_code == 200


def test_metrics_names(server):
    server.post("/generate", {"text": "count me", "sampling_params": GREEDY})
    text = server.get("/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "request_success_total",
    ):
        assert f"pdserve:{name}" in text, name
    assert server.metric("generation_tokens_total") >= 12
