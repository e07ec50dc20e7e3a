"""A real model, served as a user serves it: SmolLM2-135M-Instruct named by its GGUF file.

One `pdserve launch` (a prefill worker, a decode worker and the router) for the module, and
one offline `LLM`, both given the .gguf path. Greedy float32 decoding on CPU equals
transformers on the converted directory token for token, offline and disaggregated; the
OpenAI chat endpoint answers a real question, streamed or not, with stop strings, logprobs
that match transformers' and several sampled choices; afterwards every page is free.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.e2e.launched import Launch
from tests.e2e.sse import stream_post
from tests.real_models import chat_prompt_ids

MAX_TOKENS = 32
# 64 MiB of KV cache (about 1,400 tokens of this model) per engine: enough for these
# requests, and far less memory than the CPU default.
ENGINE_ARGS = ("--max-model-len", "1024", "--kv-cache-memory", str(64 << 20))
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def launched(smollm2_gguf, smollm2_dir):
    """The cluster, started after `smollm2_dir` converted the file (the launcher finds the
    conversion in the cache)."""
    launch = Launch(str(smollm2_gguf), *ENGINE_ARGS)
    yield launch
    launch.close()


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    return chat_prompt_ids(smollm2_dir)


@pytest.fixture(scope="module")
def expected(smollm2_dir, prompts, hf_greedy):
    return [hf_greedy(str(smollm2_dir), prompt, MAX_TOKENS) for prompt in prompts]


def chat(launch: Launch, model: str, **body) -> dict:
    body = {"model": model, "messages": FRANCE, "temperature": 0, "max_tokens": 32, **body}
    response = httpx.post(launch.url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_offline_llm_from_the_gguf_file_equals_transformers(smollm2_gguf, prompts, expected):
    llm = LLM(str(smollm2_gguf), device="cpu", max_model_len=1024, kv_cache_memory=64 << 20)
    greedy = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.kv_pages_in_use == 0


def test_disaggregated_generate_equals_transformers(launched, prompts, expected):
    sampling = {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}

    def generate(prompt):
        body = {"input_ids": prompt, "sampling_params": sampling}
        response = httpx.post(launched.url + "/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["output_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:  # all at once: batched on each worker
        assert list(pool.map(generate, prompts)) == expected


def test_models_lists_the_gguf_path_as_given(launched, smollm2_gguf):
    models = httpx.get(launched.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [str(smollm2_gguf)]


def test_chat_answers_paris_the_same_streamed_or_not(launched, smollm2_gguf):
    answer = chat(launched, str(smollm2_gguf))["choices"][0]
    assert "Paris" in answer["message"]["content"]
    assert answer["finish_reason"] == "stop"  # the model's own end of turn
    body = {"model": str(smollm2_gguf), "messages": FRANCE, "temperature": 0, "max_tokens": 32}
    status, events = stream_post(launched.url + "/v1/chat/completions", {**body, "stream": True})
    assert status == 200, events
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert streamed == answer["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_stop_string_in_real_text_ends_the_answer_before_it(launched, smollm2_gguf):
    full = chat(launched, str(smollm2_gguf))["choices"][0]["message"]["content"]
    stopped = chat(launched, str(smollm2_gguf), stop=["Paris"])["choices"][0]
    assert stopped["message"]["content"] == full[: full.index("Paris")]
    assert stopped["finish_reason"] == "stop"
    assert stopped.get("stop_reason") == "Paris"


def test_chat_logprobs_match_transformers(launched, smollm2_gguf, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    choice = chat(launched, str(smollm2_gguf), logprobs=True, top_logprobs=3)["choices"][0]
    entries = choice["logprobs"]["content"]
    # transformers' greedy answer, scored token by token by the same forward pass
    [prompt] = chat_prompt_ids(smollm2_dir, [FRANCE[0]["content"]])
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        generated = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False
        )[0, len(prompt) :]
        logits = model(generated.new_tensor(prompt + generated.tolist())[None]).logits[0]
    log_probs = torch.log_softmax(logits[len(prompt) - 1 : -1].double(), dim=-1)
    want = log_probs[torch.arange(len(generated)), generated].tolist()
    assert [e["token"] for e in entries] == [tokenizer.decode([t]) for t in generated.tolist()]
    for i, entry in enumerate(entries):
        assert entry["logprob"] == pytest.approx(want[i], abs=1e-3), f"token {i}"
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0]["token"] == entry["token"], f"token {i}: {top}"
        assert top[0]["logprob"] == pytest.approx(entry["logprob"])
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)


def test_n_sampled_choices(launched, smollm2_gguf):
    choices = chat(launched, str(smollm2_gguf), n=3, temperature=1.0, seed=7, max_tokens=12)[
        "choices"
    ]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["message"]["content"] for c in choices), choices


def test_every_worker_frees_its_pages(launched):
    """Run last: whatever the tests above sent has left nothing behind on any worker."""
    workers = launched.worker_urls()
    assert len(workers) == 2
    launched.wait_workers_idle(workers)
