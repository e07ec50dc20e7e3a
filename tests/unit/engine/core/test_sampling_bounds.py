"""Sampling settings are bounded where they are built, and the sampler never yields NaN or an
id outside the vocabulary for any setting those bounds let through."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.core.request import Request
from pdserve.engine.core.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    InvalidSamplingParams,
    SamplingParams,
)
from pdserve.engine.runtime.sampler import Sampler, filtered_probs

VOCAB = 64
EOS = 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**64),
        ("seed", INT64_MAX + 1),
        ("seed", INT64_MIN - 1),
        ("top_k", 2**63),
        ("max_new_tokens", 2**63),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", 1e5),
        ("top_p", math.nan),
        ("min_p", math.inf),
        ("repetition_penalty", 1e-40),
        ("repetition_penalty", 1e3),
        ("frequency_penalty", math.nan),
        ("temperature", 10**400),
        ("top_p", -(10**309)),
        ("presence_penalty", 10**400),
        ("stop", ["x"] * (SamplingParams.MAX_STOP_STRINGS + 1)),
        ("stop", ["y" * (SamplingParams.MAX_STOP_STRING_CHARS + 1)]),
        ("stop_token_ids", [2] * (SamplingParams.MAX_STOP_TOKEN_IDS + 1)),
        ("stop_token_ids", [2**63]),
    ],
)
def test_out_of_bounds_values_name_the_field(field, value):
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("temperature", [1.0]),
        ("temperature", True),
        ("max_new_tokens", 4.0),
        ("max_new_tokens", "4"),
        ("top_k", None),
        ("seed", 1.5),
        ("stop", 5),
        ("stop", [1, 2]),
        ("stop_token_ids", ["x"]),
        ("stop_token_ids", 7),
        ("ignore_eos", "yes"),
        ("logprobs", {}),
    ],
)
def test_wrong_types_name_the_field(field, value):
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert len(str(info.value)) < 200


def test_the_edges_of_the_bounds_are_accepted():
    SamplingParams(seed=INT64_MAX, top_k=INT64_MAX, temperature=SamplingParams.MAX_TEMPERATURE)
    SamplingParams(seed=INT64_MIN, repetition_penalty=SamplingParams.MIN_REPETITION_PENALTY)
    SamplingParams(stop=["s" * SamplingParams.MAX_STOP_STRING_CHARS] * 32, stop_token_ids=[0])


def test_token_ids_are_checked_against_the_vocabulary():
    params = SamplingParams(stop_token_ids=[3, VOCAB])
    with pytest.raises(InvalidSamplingParams, match=f"must be in \\[0, {VOCAB}\\)") as info:
        params.check_vocab(VOCAB)
    assert info.value.param == "stop_token_ids"
    SamplingParams(stop_token_ids=[VOCAB - 1]).check_vocab(VOCAB)


def test_tiny_temperatures_sample_at_the_floor():
    assert SamplingParams(temperature=1e-40).sampling_temperature == SamplingParams.MIN_TEMPERATURE
    assert SamplingParams(temperature=0.7).sampling_temperature == 0.7


def _requests(params: SamplingParams, count: int, output=()) -> list[Request]:
    requests = []
    for i in range(count):
        request = Request(f"r{i}", [5, 6, 7, 5], params, 1000)
        for token in output:
            request.append_token(token)
        requests.append(request)
    return requests


EXTREME_BUT_VALID = [
    SamplingParams(temperature=1e-40),
    SamplingParams(temperature=SamplingParams.MIN_TEMPERATURE, top_p=1e-30),
    SamplingParams(temperature=SamplingParams.MAX_TEMPERATURE, min_p=1.0),
    SamplingParams(temperature=1, top_p=0.9, top_k=INT64_MAX),
    SamplingParams(temperature=1, repetition_penalty=SamplingParams.MIN_REPETITION_PENALTY),
    SamplingParams(temperature=1e-5, repetition_penalty=SamplingParams.MAX_REPETITION_PENALTY),
    SamplingParams(temperature=1, frequency_penalty=-2, presence_penalty=-2),
    SamplingParams(temperature=1, seed=INT64_MAX),
    SamplingParams(temperature=1, seed=INT64_MIN),
    # Every token banned until min_new_tokens: no mass is left anywhere.
    SamplingParams(temperature=1, min_new_tokens=4, stop_token_ids=range(VOCAB)),
    SamplingParams(temperature=0, min_new_tokens=4, stop_token_ids=range(VOCAB)),
]


@pytest.mark.parametrize("params", EXTREME_BUT_VALID, ids=range(len(EXTREME_BUT_VALID)))
@pytest.mark.parametrize("scale", [1.0, 1e30])
def test_extreme_valid_settings_give_valid_tokens(params, scale):
    sampler = Sampler((EOS,))
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0)) * scale
    requests = _requests(params, 8, output=[9, 9, 10])
    for request in requests:
        if params.seed is not None:
            request.generator = sampler.make_generator(logits.device)
    if not params.greedy:
        processed = logits.clone()
        sampler.process_logits(processed, requests)
        probs = filtered_probs(processed, [params] * 8)
        assert not probs.isnan().any()
        assert torch.allclose(probs.sum(dim=-1), torch.ones(8))
    result = sampler(logits.clone(), requests)
    assert all(0 <= t < VOCAB for t in result.token_ids)


def test_a_stray_stop_id_beyond_the_vocabulary_does_not_crash_the_sampler():
    # NOTE: SamplingParams cannot know the vocabulary; the engine checks it. The sampler
    # must not index out of range even if a caller skipped that check.
    params = SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=[VOCAB + 10])
    result = Sampler((EOS,))(torch.zeros(1, VOCAB), _requests(params, 1))
    assert 0 <= result.token_ids[0] < VOCAB
