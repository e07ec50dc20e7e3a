"""Greedy generation equals transformers token for token, and does not depend on batching,
chunking or page size."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from tests.conftest import ARCHS, random_prompts

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


LENGTHS = (1, 7, 16, 33, 90)
GREEDY_32 = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_equals_transformers(arch, tiny_model_dirs, hf_greedy):
    model_dir = tiny_model_dirs(arch)
    llm = LLM(model_dir, device="cpu", dtype="float32")
    prompts = random_prompts(LENGTHS, llm.engine.model_config.vocab_size, seed=1)
    outputs = llm.generate(prompts, GREEDY_32)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.token_ids == hf_greedy(model_dir, prompt, 32), f"prompt length {len(prompt)}"
        assert output.finish_reason == "length"


def test_text_prompts_equal_transformers(tiny_model_dirs, hf_greedy):
    model_dir = tiny_model_dirs("llama")
    llm = LLM(model_dir, device="cpu")
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 3]
    outputs = llm.generate(texts, GREEDY_32)
    for text, output in zip(texts, outputs, strict=True):
        ids = llm.tokenizer.encode(text)
        assert output.prompt_token_ids == ids
        assert output.token_ids == hf_greedy(model_dir, ids, 32)
        assert output.prompt == text
        assert output.text == llm.tokenizer.decode(output.token_ids, skip_special_tokens=True)


def _generate(model_dir, prompts, **options):
    llm = LLM(model_dir, device="cpu", **options)
    return [o.token_ids for o in llm.generate(prompts, GREEDY_32)]


@pytest.fixture(scope="module")
def qwen3_case(tiny_model_dirs):
    model_dir = tiny_model_dirs("qwen3")
    prompts = random_prompts((3, 20, 47, 64, 101, 5), 1000, seed=2)
    return model_dir, prompts, _generate(model_dir, prompts)


def test_batched_equals_one_at_a_time(qwen3_case):
    model_dir, prompts, batched = qwen3_case
    llm = LLM(model_dir, device="cpu")
    alone = [llm.generate([p], GREEDY_32)[0].token_ids for p in prompts]
    assert alone == batched


@pytest.mark.parametrize("chunk", [1, 8, 50])
def test_chunked_prefill_equals_unchunked(qwen3_case, chunk):
    model_dir, prompts, _ = qwen3_case
    unchunked = _generate(model_dir, prompts, chunked_prefill_size=0)
    assert _generate(model_dir, prompts, chunked_prefill_size=chunk) == unchunked


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_page_sizes_give_same_tokens(qwen3_case, page_size):
    model_dir, prompts, reference = qwen3_case
    assert _generate(model_dir, prompts, page_size=page_size) == reference


def test_preemption_under_memory_pressure_gives_same_tokens(qwen3_case):
    model_dir, prompts, reference = qwen3_case
    llm = LLM(model_dir, device="cpu", page_size=4)
    page_bytes = llm.engine.kv_pool.nbytes // llm.engine.kv_pool.num_pages
    # Room for ~1.5 of the longest sequences at a time: admission waits and decode preempts.
    tight = LLM(
        model_dir, device="cpu", page_size=4, kv_cache_memory=page_bytes * 50, max_model_len=180
    )
    requests = [tight.engine.add_request(f"r{i}", p, GREEDY_32) for i, p in enumerate(prompts)]
    while tight.engine.has_unfinished():
        tight.engine.step()
    assert [r.output_token_ids for r in requests] == reference
    assert sum(r.num_preemptions for r in requests) > 0
    assert tight.engine.kv_pages_in_use == 0


def test_mistral_sliding_window_equals_transformers(tmp_path, hf_greedy):
    from pdserve.synthetic.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "mistral-sw", "mistral", sliding_window=12))
    llm = LLM(model_dir, device="cpu")
    assert llm.engine.model_config.sliding_window == 12
    prompts = random_prompts((5, 30, 47), 1000, seed=6)
    outputs = llm.generate(prompts, GREEDY_32)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.token_ids == hf_greedy(model_dir, prompt, 32), f"prompt length {len(prompt)}"


def test_bfloat16_on_cpu_follows_transformers(tiny_model_dirs, hf_greedy):
    import torch

    model_dir = tiny_model_dirs("qwen2")
    llm = LLM(model_dir, device="cpu", dtype="bfloat16")
    prompts = random_prompts((4, 20, 60), 1000, seed=7)
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0))
    firsts = [hf_greedy(model_dir, p, 1, dtype=torch.bfloat16)[0] for p in prompts]
    assert [o.token_ids[0] for o in outputs] == firsts
