"""SGLang's native API and the worker's health and metrics endpoints."""

from __future__ import annotations

import json

import httpx

from pdserve import LLM, SamplingParams

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def test_generate_text(server):
    out = server.post("/generate", {"text": "Hello", "sampling_params": GREEDY}).json()
    assert len(out["output_ids"]) == 12
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
    body = {"text": "Stream me", "sampling_params": GREEDY, "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=30) as response:
        events = [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")
        ]
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
