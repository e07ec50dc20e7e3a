"""SmolLM2-135M-Instruct (tests/real_models.py) on CUDA through the Triton backend: its odd
head group (9 query heads over 3 KV heads of 64 dims) in the real kernels, CUDA graphs
included. float32 greedy equals transformers (float32 on CUDA) on chat prompts; bfloat16
answers a real question. Skipped without a GPU; run on the device machine."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.real_models import chat_prompt_ids

pytestmark = pytest.mark.gpu

KV_BYTES = 256 << 20
MAX_MODEL_LEN = 1024  # the model's 8192 would not fit KV_BYTES in float32
MAX_TOKENS = 32


def test_float32_triton_greedy_equals_transformers(smollm2_gguf, smollm2_dir, hf_greedy):
    llm = LLM(
        str(smollm2_gguf),
        device="cuda",
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=KV_BYTES,
        attention_backend="triton",
    )
    prompts = chat_prompt_ids(smollm2_dir)
    greedy = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(
            str(smollm2_dir), prompt, MAX_TOKENS, device="cuda", dtype=torch.float32
        )
        assert output.token_ids == expected, llm.tokenizer.decode(prompt)


def test_bfloat16_answers_the_capital_of_france(smollm2_gguf, smollm2_dir):
    llm = LLM(
        str(smollm2_gguf),
        device="cuda",
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=KV_BYTES,
    )
    [prompt] = chat_prompt_ids(smollm2_dir, ["What is the capital of France?"])
    [output] = llm.generate([prompt], SamplingParams(max_new_tokens=32, temperature=0))
    assert "Paris" in output.text
    assert output.finish_reason == "stop"
