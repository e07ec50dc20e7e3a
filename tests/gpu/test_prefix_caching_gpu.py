"""Prefix caching on CUDA: Triton attention, CUDA graphs and overlap scheduling (steps really
run ahead of the host there) give the tokens of no caching, float32 greedy, for prompts that
share prefixes, one at a time and all at once, with evictions under a small KV pool."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from tests.conftest import random_prompts

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
# float32 so that batching cannot flip a near-tie; a small pool: two engines share the GPU.
CUDA = {"device": "cuda", "dtype": "float32", "page_size": 16, "kv_cache_memory": 64 << 20}


@pytest.mark.parametrize("kv_pages", [None, 40], ids=["roomy", "evicting"])
def test_cached_prefixes_give_the_tokens_of_no_caching_on_cuda(tiny_model_dirs, kv_pages):
    model = tiny_model_dirs("llama")
    options = {**CUDA, "max_model_len": 256}
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


def test_a_burst_reads_pages_of_running_requests_with_steps_running_ahead(tiny_model_dirs):
    """Overlap scheduling on CUDA: a request's prompt pages are shared only once the step
    that computed them has landed, and requests admitted after read them while it still
    runs; the tokens equal no caching."""
    model = tiny_model_dirs("qwen3")
    # Chunks of 64 tokens: the system prompt takes several steps.
    options = {**CUDA, "max_model_len": 512, "chunked_prefill_size": 64}
    reference = LLM(model, disable_prefix_caching=True, **options)
    cached = LLM(model, **options)
    assert cached.engine.overlap
    vocab = reference.engine.model_config.vocab_size
    system = random_prompts((200,), vocab, seed=3)[0]
    prompts = [system + tail for tail in random_prompts([5, 9, 13, 17, 21, 25], vocab, seed=4)]
    expected = [o.token_ids for o in reference.generate(prompts, GREEDY)]
    engine = cached.engine
    requests = [engine.add_request(f"b{i}", p, GREEDY) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in requests] == expected
    assert requests[0].num_cached_tokens == 0
    assert sum(r.num_cached_tokens for r in requests[1:]) >= 5 * 128
    assert engine.kv_pages_in_use == 0
