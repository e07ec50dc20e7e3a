"""Speculative verification over the graph runner's static inputs (a fixed number of tokens per
sequence, padded) against the target's plain output.

Without CUDA nothing is captured: the runner runs its padded static inputs eagerly (under the
Triton interpreter), which is everything a graph replays except the capture itself; on a GPU
the same cases replay graphs. A chain drafted by a copy of the target is accepted whole, so
its last drafts are cut short by the token limit (padding rows inside a sequence), and its
draft steps run over static inputs as well (`ChainDraftGraphs`), as does every draft's
catch-up on the verified tokens; a tree
verifies under its mask; n-gram proposals vary in length, and an empty one is a plain decode
step. Four requests with different limits shrink the batch through the buckets and past them.
"""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.protocol.spec_settings import SpecSettings
from tests.conftest import random_prompts

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ENGINE = {"device": DEVICE, "dtype": "float32", "kv_cache_memory": 256 << 20, "page_size": 4}
LIMITS = [9, 22, 4, 11]
# (algorithm, steps, topk, draft tokens): verification graphs hold 12 tokens, so 3 requests
# of 4 tokens, or 2 of 6.
CASES = {
    "chain": ("STANDALONE", 3, 1, 4),
    "tree": ("EAGLE3", 3, 3, 6),
    "ngram": ("NGRAM", 3, 1, 4),
}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts((1, 4, 9, 23), 1000, seed=3)


def _params():
    return [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in LIMITS]


@pytest.fixture(scope="module")
def expected(tiny_model_dirs, prompts):
    llm = LLM(tiny_model_dirs("llama"), **ENGINE)
    return [o.token_ids for o in llm.generate(prompts, _params())]


@pytest.mark.parametrize("case", CASES)
def test_verification_over_static_inputs_is_exact(
    case, tiny_model_dirs, spec_drafts, prompts, expected
):
    algorithm, steps, topk, tokens = CASES[case]
    settings = SpecSettings(algorithm, spec_drafts[algorithm], steps, topk, tokens)
    llm = LLM(
        tiny_model_dirs("llama"),
        attention_backend="triton",
        cuda_graph_max_bs=12,
        speculative=settings,
        **ENGINE,
    )
    outputs = llm.generate(prompts, _params())
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.kv_pages_in_use == 0
    graphs = llm.engine.runner.verify_graphs
    assert graphs.tokens_per_seq == tokens and graphs.max_bs == 12 // tokens
    runs = graphs.eager_runs + graphs.replays
    assert runs.total() > 0, "no verification ran over static inputs"
    if case != "ngram":  # n-grams rarely match a random model's text: few verifications
        assert 1 in runs, "the batch never shrank to one request"
    if DEVICE == "cpu":
        assert not graphs.replays, "nothing is captured without CUDA"
    else:
        assert not graphs.eager_runs, "a captured bucket ran eagerly"
    if case == "chain":
        assert (
            sum(o.spec_emitted_tokens for o in outputs) / sum(o.spec_verify_ct for o in outputs) > 2
        ), "a copy of the target should have its drafts accepted"


def test_without_graphs_verification_takes_the_plain_path(tiny_model_dirs, spec_drafts):
    settings = SpecSettings("NGRAM", None, 3, 1, 4)
    llm = LLM(
        tiny_model_dirs("llama"),
        attention_backend="triton",
        disable_cuda_graph=True,
        speculative=settings,
        **ENGINE,
    )
    assert llm.engine.runner.verify_graphs is None
    assert llm.engine.runner.decode_graphs is None


def test_chains_left_on_the_device_verify_as_chains_copied_first(
    tiny_model_dirs, spec_drafts, prompts
):
    """Chains left on the device (the step copies them once, with the target's choices, after
    verification) emit what chains copied to the host before the pass emit, for requests
    that sample with a seed, ask for logprobs, or adjust their logits; a copy of the target
    drafting, every request's greedy chain is accepted (each reads its own drafted row)."""
    settings = SpecSettings("STANDALONE", spec_drafts["STANDALONE"], 3, 1, 4)
    params = [
        SamplingParams(max_new_tokens=9, temperature=0.9, top_p=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_new_tokens=14, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_new_tokens=6, temperature=0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_new_tokens=11, temperature=0, min_new_tokens=5),
    ]
    results = {}
    for graphs in (True, False):
        llm = LLM(
            tiny_model_dirs("llama"),
            attention_backend="triton",
            cuda_graph_max_bs=12,
            disable_cuda_graph=not graphs,
            speculative=settings,
            **ENGINE,
        )
        results[graphs] = llm.generate(prompts, params)
        on_device = llm.engine.speculator.steps_drafted_on_device
        assert (on_device > 0) == graphs, f"{on_device} steps drafted on the device"
        assert llm.engine.kv_pages_in_use == 0
    for device, host in zip(results[True], results[False], strict=True):
        assert device.token_ids == host.token_ids
        if host.logprobs is not None:
            assert torch.allclose(torch.tensor(device.logprobs), torch.tensor(host.logprobs))
    for out in results[True][1:]:  # the greedy ones
        assert out.spec_emitted_tokens / out.spec_verify_ct > 2, "drafts were not accepted"
