"""Prefix caching on CUDA: Triton attention, CUDA graphs and overlap scheduling (steps really
run ahead of the host there) give the tokens of no caching, float32 greedy, for prompts that
share prefixes, one at a time and all at once, with evictions under a small KV pool."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from tests.conftest import random_prompts

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("kv_pages", [None, 40], ids=["roomy", "evicting"])
def test_cached_prefixes_give_the_tokens_of_no_caching_on_cuda(tiny_model_dirs, kv_pages):
    model = tiny_model_dirs("llama")
    options = {
        "device": "cuda",
        "dtype": "float32",
        "page_size": 16,
        "max_model_len": 256,
        "kv_cache_memory": 64 << 20,  # two engines share the GPU
    }
    reference = LLM(model, disable_prefix_caching=True, **options)
    if kv_pages is not None:
        pool = reference.engine.kv_pool
        options["kv_cache_memory"] = pool.nbytes // pool.num_pages * kv_pages
    cached = LLM(model, **options)
    assert cached.engine.overlap and cached.engine.prefix_cache is not None
    vocab = reference.engine.model_config.vocab_size
    stems = random_prompts((16, 40, 100), vocab, seed=1)
    tails = random_prompts([1, 7, 16, 30] * 3, vocab, seed=2)
    prompts = [stems[i % 3] + tail for i, tail in enumerate(tails)] + stems
    expected = [o.token_ids for o in reference.generate(prompts, GREEDY)]
    one_at_a_time = [cached.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert one_at_a_time == expected
    assert [o.token_ids for o in cached.generate(prompts, GREEDY)] == expected
    cache = cached.engine.prefix_cache
    assert cache.num_pages > 0 and cached.engine.kv_pages_in_use == 0
    assert (cache.num_evicted > 0) == (kv_pages is not None)
