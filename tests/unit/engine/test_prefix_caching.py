"""Prefix caching in the engine: greedy output with the cache equals output without it, token
for token (float32), whatever the shared prefix (inside a page, on a page boundary, the whole
prompt, a conversation's earlier turn), under eviction and preemption, with aborts of
requests that share pages; and a failed step's KV is never cached."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from tests.conftest import random_prompts

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


PAGE = 4
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_dirs):
    return tiny_model_dirs("llama")


def _llm(model, **options) -> LLM:
    return LLM(model, device="cpu", dtype="float32", page_size=PAGE, **options)


def _run(engine, prompts, params=GREEDY, prefix="r"):
    requests = [engine.add_request(f"{prefix}{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return requests


def _prompts_sharing_prefixes(vocab):
    base = random_prompts((40,), vocab, seed=11)[0]
    tails = random_prompts((1, 3, 5, 9, 17), vocab, seed=12)
    return [
        base,
        base[:6] + tails[0],  # shares 6 tokens: one full page and two tokens of the next
        base[:8] + tails[1],  # shares exactly two pages
        list(base),  # the whole prompt again: all but the last page come from the cache
        base[:39],  # a prefix of the first prompt
        base[:8],  # two pages, all of them shared: the last is computed for its logits
        base[:20] + tails[4],
        tails[2],  # nothing shared
    ]


def test_shared_prefixes_of_every_length_give_the_tokens_of_no_caching(model):
    cached = _llm(model)
    vocab = cached.engine.model_config.vocab_size
    prompts = _prompts_sharing_prefixes(vocab)
    reference = _llm(model, disable_prefix_caching=True)
    assert reference.engine.prefix_cache is None
    expected = [r.output_token_ids for r in _run(reference.engine, prompts)]
    # One request at a time, so each finds what the ones before it left.
    got, saved = [], []
    for i, prompt in enumerate(prompts):
        (request,) = _run(cached.engine, [prompt], prefix=f"one{i}-")
        got.append(request.output_token_ids)
        saved.append(request.num_cached_tokens)
    assert got == expected
    assert saved == [0, 4, 8, 36, 36, 4, 20, 0]
    assert cached.engine.kv_pages_in_use == 0 and cached.engine.prefix_cache.num_pages > 0
    # All at once too: requests admitted in one step share what is cached by then.
    again = _run(cached.engine, prompts, prefix="all-")
    assert [r.output_token_ids for r in again] == expected
    assert all(r.num_cached_tokens > 0 for r in again[:7])


def test_a_conversation_reuses_its_earlier_turns(model):
    """Turn n + 1's prompt is turn n's prompt, its answer and a new message: everything but
    the new message (and the page it starts in) comes from the cache."""
    cached, reference = _llm(model), _llm(model, disable_prefix_caching=True)
    vocab = cached.engine.model_config.vocab_size
    messages = random_prompts((13, 6, 9, 4), vocab, seed=5)
    history_cached, history_ref = [], []
    for turn, message in enumerate(messages):
        prompt = history_cached + message
        assert prompt == history_ref + message
        (ours,) = _run(cached.engine, [prompt], prefix=f"turn{turn}-")
        (theirs,) = _run(reference.engine, [prompt], prefix=f"turn{turn}-")
        assert ours.output_token_ids == theirs.output_token_ids
        if turn:
            # the earlier turn's KV was computed up to its last generated token but one
            assert ours.num_cached_tokens == (len(history_cached) - 1) // PAGE * PAGE
        history_cached = prompt + ours.output_token_ids
        history_ref = prompt + theirs.output_token_ids


def test_eviction_under_memory_pressure_keeps_tokens_exact(model):
    roomy = _llm(model, disable_prefix_caching=True)
    vocab = roomy.engine.model_config.vocab_size
    stems = random_prompts((16, 16, 16), vocab, seed=3)
    tails = random_prompts([5] * 12, vocab, seed=4)
    prompts = [stems[i % 3] + tail for i, tail in enumerate(tails)]
    expected = [r.output_token_ids for r in _run(roomy.engine, prompts)]
    page_bytes = roomy.engine.kv_pool.nbytes // roomy.engine.kv_pool.num_pages
    tight = _llm(model, kv_cache_memory=page_bytes * 24, max_model_len=40)
    got = []
    for i, prompt in enumerate(prompts):  # one at a time: the cache fills, then evicts
        got += [r.output_token_ids for r in _run(tight.engine, [prompt], prefix=f"e{i}-")]
    assert got == expected
    cache = tight.engine.prefix_cache
    assert cache.num_evicted > 0 and tight.engine.kv_pages_in_use == 0
    assert cache.num_pages + tight.engine.allocator.num_free == tight.engine.kv_pool.num_pages


def test_preemption_with_a_shared_prefix_keeps_tokens_exact(model):
    roomy = _llm(model, disable_prefix_caching=True)
    vocab = roomy.engine.model_config.vocab_size
    stem = random_prompts((12,), vocab, seed=8)[0]
    prompts = [stem + tail for tail in random_prompts([3, 7, 2, 9, 5, 6], vocab, seed=9)]
    long = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    expected = [r.output_token_ids for r in _run(roomy.engine, prompts, long)]
    page_bytes = roomy.engine.kv_pool.nbytes // roomy.engine.kv_pool.num_pages
    tight = _llm(model, kv_cache_memory=page_bytes * 30, max_model_len=60)
    requests = _run(tight.engine, prompts, long)
    assert [r.output_token_ids for r in requests] == expected
    assert sum(r.num_preemptions for r in requests) > 0
    assert tight.engine.kv_pages_in_use == 0


def test_aborting_requests_that_share_pages_leaves_the_others_exact(model):
    cached, reference = _llm(model), _llm(model, disable_prefix_caching=True)
    vocab = cached.engine.model_config.vocab_size
    stem = random_prompts((16,), vocab, seed=21)[0]
    prompts = [stem + tail for tail in random_prompts([4, 6, 3, 8], vocab, seed=22)]
    expected = [r.output_token_ids for r in _run(reference.engine, prompts)]
    _run(cached.engine, [[*stem, 7]], prefix="warm")  # the stem's pages are cached now
    engine = cached.engine
    requests = [engine.add_request(f"a{i}", p, GREEDY) for i, p in enumerate(prompts)]
    engine.step()
    engine.step()
    shared = requests[0].cached_pages[0]
    assert shared.refs == 4, "all four read the stem's first page"
    assert engine.abort_request("a1") and engine.abort_request("a3")
    assert shared.refs == 2
    while engine.has_unfinished():
        engine.step()
    assert [requests[0].output_token_ids, requests[2].output_token_ids] == [
        expected[0],
        expected[2],
    ]
    assert engine.kv_pages_in_use == 0 and shared.refs == 0


def test_a_failed_steps_kv_is_not_cached(model):
    cached = _llm(model)
    engine = cached.engine
    vocab = engine.model_config.vocab_size
    prompt = random_prompts((20,), vocab, seed=31)[0]
    engine.add_request("f", prompt, GREEDY)
    engine.step()  # prefilled: its KV is in its pages
    engine.fail_step("the device fell over")
    assert engine.prefix_cache.num_pages == 0 and engine.kv_pages_in_use == 0
    assert engine.allocator.num_used == 0
    (again,) = _run(engine, [prompt], prefix="again")
    assert again.num_cached_tokens == 0


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE3"])
def test_speculative_decoding_caches_only_without_draft_kv(model, spec_drafts, algorithm):
    """NGRAM drafts from the tokens alone: the target's pages cache, and output stays exact.
    An EAGLE-3 draft keeps KV whose last slot in a page depends on the next page's first
    token, so it cannot be keyed by the page's tokens: caching is off."""
    from pdserve.protocol.spec_settings import SpecSettings

    settings = SpecSettings(algorithm, spec_drafts[algorithm], 3, 1, 4)
    spec = _llm(model, speculative=settings)
    if algorithm == "EAGLE3":
        assert spec.engine.prefix_cache is None
        return
    reference = _llm(model, disable_prefix_caching=True)
    prompts = _prompts_sharing_prefixes(reference.engine.model_config.vocab_size)
    prompts += [[11, 12, 13, 14] * 6, [11, 12, 13, 14] * 5 + [11]]  # NGRAM has matches here
    expected = [r.output_token_ids for r in _run(reference.engine, prompts)]
    got = [_run(spec.engine, [p], prefix=f"s{i}-")[0] for i, p in enumerate(prompts)]
    assert [r.output_token_ids for r in got] == expected
    assert sum(r.num_cached_tokens for r in got) > 0 and sum(r.spec_verify_steps for r in got)
    assert spec.engine.kv_pages_in_use == 0


def test_a_prefill_engine_reuses_its_cache_and_the_handoff_stays_exact(model):
    """A prefill engine lets a handed-off request's pages go into its cache once their KV is
    sent: the next prompt with the same stem computes only what follows it."""
    from tests.unit.local_connectors import hand_off, pair

    engine_p, engine_d = _llm(model).engine, _llm(model).engine
    prefill, decode = pair(engine_p, engine_d)
    vocab = engine_p.model_config.vocab_size
    stem = random_prompts((13,), vocab, seed=41)[0]
    prompts = [stem + tail for tail in random_prompts([3, 6], vocab, seed=42)]
    reference = _llm(model, disable_prefix_caching=True)
    expected = [r.output_token_ids for r in _run(reference.engine, prompts)]
    for i, prompt in enumerate(prompts):
        outputs = hand_off(prefill, decode, f"p{i}", prompt, GREEDY, room=i + 1)
        assert prefill.records[f"p{i}"].cached_tokens == (12 if i else 0)
        assert [t for o in outputs for t in o.new_token_ids] == expected[i]
    assert engine_p.kv_pages_in_use == 0 and engine_d.kv_pages_in_use == 0
    assert engine_p.prefix_cache.num_pages == 5  # the stem's 3 pages and each prompt's 4th


def test_overlap_scheduling_caches_what_its_steps_computed(model):
    """With overlap scheduling a request's newest token is a placeholder until its step
    lands: pages are cached up to the tokens the host knows, and found again."""
    cached = _llm(model)
    cached.engine.overlap = True  # on CPU only the bookkeeping overlaps, which is what counts
    reference = _llm(model, disable_prefix_caching=True)
    prompts = _prompts_sharing_prefixes(reference.engine.model_config.vocab_size)
    expected = [r.output_token_ids for r in _run(reference.engine, prompts)]
    got = [_run(cached.engine, [p], prefix=f"o{i}-")[0] for i, p in enumerate(prompts)]
    assert [r.output_token_ids for r in got] == expected
    assert [r.num_cached_tokens for r in got] == [0, 4, 8, 36, 36, 4, 20, 0]
    assert cached.engine.in_flight is None and cached.engine.kv_pages_in_use == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_burst_reads_the_prompt_pages_of_requests_still_running(model, overlap):
    """Requests that share a system prompt arrive together: once the first has computed
    pages of it (a prefill chunk at a time), the ones admitted after read them, while the
    first still runs; tokens equal no caching. With overlap scheduling a step's pages are
    shared one step later (its step may still be running)."""
    cached = _llm(model, chunked_prefill_size=8, max_running_requests=8)
    cached.engine.overlap = overlap
    reference = _llm(model, disable_prefix_caching=True, chunked_prefill_size=8)
    vocab = reference.engine.model_config.vocab_size
    system = random_prompts((24,), vocab, seed=41)[0]
    prompts = [system + tail for tail in random_prompts((3, 5, 6, 9), vocab, seed=42)]
    expected = [r.output_token_ids for r in _run(reference.engine, prompts)]
    got = _run(cached.engine, prompts)
    assert [r.output_token_ids for r in got] == expected
    # The first computes the system prompt; each later one finds its pages in the cache.
    assert got[0].num_cached_tokens == 0
    assert all(r.num_cached_tokens >= 16 for r in got[1:]), [r.num_cached_tokens for r in got]
    assert cached.engine.kv_pages_in_use == 0
    cache = cached.engine.prefix_cache
    assert cache.num_unreferenced == cache.num_pages
