"""Sampler rules, checked on fixed logits (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.core.request import Request
from pdserve.engine.core.sampling_params import InvalidSamplingParams, SamplingParams
from pdserve.engine.runtime.sampler import Sampler

VOCAB = 32
EOS = 1


def requests_for(params: SamplingParams, count: int, output=()):
    reqs = []
    for i in range(count):
        request = Request(f"r{i}", [5, 6, 7], params, 100)
        for token in output:
            request.append_token(token)
        reqs.append(request)
    return reqs


def fixed_logits(count: int, seed: int = 0) -> torch.Tensor:
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    return row.repeat(count, 1)


def draw(params: SamplingParams, count=4000, logits=None):
    logits = fixed_logits(count) if logits is None else logits
    row = logits[0].clone()
    tokens = Sampler((EOS,))(logits, requests_for(params, count)).token_ids
    return row, torch.tensor(tokens)


def test_greedy_takes_argmax():
    row, tokens = draw(SamplingParams(temperature=0), count=3)
    assert tokens.tolist() == [int(row.argmax())] * 3


def test_top_k_never_leaves_the_k_best_and_reaches_all_of_them():
    row, tokens = draw(SamplingParams(temperature=1.5, top_k=5))
    allowed = set(row.topk(5).indices.tolist())
    assert set(tokens.tolist()) == allowed


def test_top_p_keeps_the_smallest_nucleus_and_its_proportions():
    row, tokens = draw(SamplingParams(temperature=1.0, top_p=0.6), count=20000)
    probs = row.softmax(-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = order[mass_before < 0.6]
    assert set(tokens.tolist()) <= set(nucleus.tolist())
    expected = probs[nucleus] / probs[nucleus].sum()
    observed = torch.bincount(tokens, minlength=VOCAB)[nucleus].float() / len(tokens)
    # 5 standard errors of a binomial proportion for 20000 draws.
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / len(tokens))
    assert torch.all((observed - expected).abs() <= tolerance)


def test_min_p_drops_tokens_below_the_threshold():
    row, tokens = draw(SamplingParams(temperature=1.0, min_p=0.2))
    probs = row.softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    assert set(tokens.tolist()) <= allowed
    assert len(allowed) < VOCAB


def test_combined_top_k_and_top_p_respect_both():
    row, tokens = draw(SamplingParams(temperature=0.7, top_k=3, top_p=0.9))
    assert set(tokens.tolist()) <= set(row.topk(3).indices.tolist())


def test_seeded_rows_reproduce_regardless_of_batch():
    params = SamplingParams(temperature=1.0, seed=1234)
    sampler = Sampler((EOS,))

    def run(count, output=()):
        reqs = requests_for(params, count, output=list(output))
        drawn = []
        for r in reqs:
            r.generator = sampler.make_generator(torch.device("cpu"))
        for _ in range(20):
            tokens = sampler(fixed_logits(count), reqs).token_ids
            for request, token in zip(reqs, tokens, strict=True):
                request.append_token(token)
            drawn.append(tokens[0])
        return drawn

    alone = run(1)
    assert alone == run(1)
    assert alone == run(7)
    assert len(set(alone)) > 1
    # A draw depends on the seed and the output position only: a request that arrives with
    # 5 tokens already drawn elsewhere (a handoff) continues the same sequence.
    assert run(1, output=alone[:5])[:15] == alone[5:]


def test_min_new_tokens_suppresses_eos_and_stop_ids():
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, EOS] = 10.0
    logits[0, 3] = 9.0
    logits[0, 4] = 8.0
    params = SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=(3,))
    assert Sampler((EOS,))(logits.clone(), requests_for(params, 1)).token_ids == [4]
    done = requests_for(params, 1, output=[9, 9])
    assert Sampler((EOS,))(logits.clone(), done).token_ids == [EOS]


def test_repetition_penalty_pushes_seen_tokens_down():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 2.0  # token 5 is in the prompt
    logits[0, 9] = 1.5
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert Sampler((EOS,))(logits, requests_for(params, 1)).token_ids == [9]


def test_frequency_and_presence_penalties_count_output_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 9] = 2.0
    logits[0, 10] = 1.0
    frequency = SamplingParams(temperature=0, frequency_penalty=0.6)
    out = Sampler((EOS,))(logits.clone(), requests_for(frequency, 1, output=[9, 9])).token_ids
    assert out == [10]  # 2.0 - 2 * 0.6 < 1.0
    presence = SamplingParams(temperature=0, presence_penalty=0.9)
    out = Sampler((EOS,))(logits.clone(), requests_for(presence, 1, output=[9, 9])).token_ids
    assert out == [9]  # 2.0 - 0.9 > 1.0: presence counts once


def test_logprobs_are_raw_and_top_n_sorted():
    logits = fixed_logits(1)
    raw = torch.log_softmax(logits[0], -1)
    params = SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5)
    result = Sampler((EOS,))(logits.clone(), requests_for(params, 1))
    token = result.token_ids[0]
    assert math.isclose(result.logprobs[0], raw[token].item(), rel_tol=1e-6)
    top = result.top_logprobs[0]
    assert list(top) == raw.topk(3).indices.tolist()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("max_new_tokens", 0),
        ("repetition_penalty", 0.0),
        ("logprobs", 21),
        ("frequency_penalty", 3.0),
        ("presence_penalty", -2.5),
    ],
)
def test_invalid_sampling_params_name_the_parameter(field, value):
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_a_draw_is_what_multinomial_draws_from_the_same_generator_state():
    """`draw` skips `torch.multinomial`'s validity check (a host sync on a GPU) and keeps its
    draws: a seed gives the tokens it gave before, rows and single rows alike."""
    from pdserve.engine.runtime.sampler import draw

    probs = torch.rand(8, VOCAB, generator=torch.Generator().manual_seed(1)).softmax(dim=-1)
    probs[:, :4] = 0  # tokens no row may draw
    for seed in range(20):
        expected = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))
        got = draw(probs, torch.Generator().manual_seed(seed))
        assert torch.equal(got, expected[:, 0])
        assert (got >= 4).all()
        one = torch.multinomial(probs[3], 1, generator=torch.Generator().manual_seed(seed))
        assert draw(probs[3], torch.Generator().manual_seed(seed)).item() == one.item()
    torch.manual_seed(5)
    expected = torch.multinomial(probs, 1)[:, 0]
    torch.manual_seed(5)
    assert torch.equal(draw(probs), expected)
