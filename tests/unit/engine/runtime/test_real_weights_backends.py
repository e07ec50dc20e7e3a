"""SmolLM2-135M's real weights, cut to two layers, through both attention backends: greedy
float32 tokens equal transformers' on the same cut.

The tiny test models all have even head groups; SmolLM2 has 9 query heads over 3 KV heads of
64 dims. The Triton kernels run under Triton's interpreter on CPU (tests/conftest.py), which
is slow: two short prompts, four tokens each (a prefill, then decode steps)."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from tests.real_models import cut_layers

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


pytest.importorskip("triton")

NUM_TOKENS = 4
TEXTS = ("The capital of France is", "def fibonacci(n):\n    ")


@pytest.fixture(scope="module")
def two_layers(smollm2_dir, tmp_path_factory) -> str:
    return str(cut_layers(smollm2_dir, tmp_path_factory.mktemp("smollm2-2-layers"), 2))


@pytest.fixture(scope="module")
def prompts(two_layers) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(two_layers)
    return [tokenizer.encode(text) for text in TEXTS]


def test_the_cut_keeps_the_real_shapes(two_layers):
    from pdserve.engine.checkpoint.model_config import ModelConfig

    config = ModelConfig.from_pretrained(two_layers)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (2, 9, 3)
    assert config.head_dim == 64


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_on_each_backend_equals_transformers(backend, two_layers, prompts, hf_greedy):
    llm = LLM(
        two_layers, device="cpu", dtype="float32", max_model_len=64, attention_backend=backend
    )
    greedy = SamplingParams(max_new_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [hf_greedy(two_layers, p, NUM_TOKENS) for p in prompts]
    assert llm.engine.kv_pages_in_use == 0
