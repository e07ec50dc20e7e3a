"""pdserve.bench workloads and arrival times: seeded, within their ranges, multi-turn turns
sharing their prefixes, Poisson gaps of the right mean."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from pdserve.bench.runner import Load, arrival_offsets
from pdserve.bench.workloads import (
    WORDS,
    LengthRange,
    WorkloadSpec,
    build_workload,
    sharegpt_lengths,
)


def spec(name="random", chat=False, **kw) -> WorkloadSpec:
    kw.setdefault("input_len", LengthRange(5, 40))
    kw.setdefault("output_len", LengthRange(2, 9))
    return WorkloadSpec(name, chat, **kw)


def test_length_ranges_parse_and_refuse():
    assert LengthRange.parse("32") == LengthRange(32, 32)
    assert LengthRange.parse("8:64") == LengthRange(8, 64)
    for bad in ("0", "9:3", "a:b", "4:"):
        with pytest.raises(ValueError, match="length range"):
            LengthRange.parse(bad)


def test_random_workload_is_seeded_and_within_its_ranges():
    first = build_workload(spec(token_id_min=3, token_id_max=250), 200, seed=7)
    assert first == build_workload(spec(token_id_min=3, token_id_max=250), 200, seed=7)
    assert first != build_workload(spec(token_id_min=3, token_id_max=250), 200, seed=8)
    prompts = [c.turns[0].prompt for c in first]
    outputs = [c.turns[0].max_tokens for c in first]
    assert {len(p) for p in prompts} <= set(range(5, 41))
    assert min(len(p) for p in prompts) == 5 and max(len(p) for p in prompts) == 40
    assert set(outputs) == set(range(2, 10))  # 200 draws hit all 8 values
    ids = [i for p in prompts for i in p]
    assert min(ids) >= 3 and max(ids) < 250 and max(ids) > 240


def test_random_chat_prompts_are_words():
    conversations = build_workload(spec(chat=True), 20, seed=0)
    for conversation in conversations:
        text = conversation.messages([])[0]["content"]
        assert 5 <= len(text.split()) <= 40 and set(text.split()) <= set(WORDS)


def test_sharegpt_lengths_are_skewed_and_clipped():
    rng = random.Random(0)
    pairs = [sharegpt_lengths(rng, 1024, 512) for _ in range(4000)]
    inputs, outputs = [p for p, _ in pairs], [o for _, o in pairs]
    assert min(inputs) >= 4 and max(inputs) == 1024 and max(outputs) == 512
    # lognormal: the median near exp(mu) and the mean well above it (a long right tail)
    assert 190 < statistics.median(inputs) < 250 and statistics.fmean(inputs) > 300
    assert 160 < statistics.median(outputs) < 200 and statistics.fmean(outputs) > 200
    clipped = build_workload(spec("sharegpt", chat=True, max_input_len=64, max_output_len=8), 50, 1)
    assert all(len(c.turns[0].prompt.split()) <= 64 for c in clipped)
    assert all(1 <= c.turns[0].max_tokens <= 8 for c in clipped)


def test_multi_turn_turns_extend_the_previous_turns_messages():
    conversations = build_workload(
        spec("multi-turn", chat=True, num_turns=3, system_prompt_len=6, shared_prefix_len=4),
        5,
        seed=2,
    )
    answers = ["first answer", "second answer"]
    for conversation in conversations:
        assert len(conversation.turns) == 3
        for turn in (1, 2):
            before = conversation.messages(answers[: turn - 1])
            now = conversation.messages(answers[:turn])
            assert now[: len(before)] == before
            assert now[len(before)] == {"role": "assistant", "content": answers[turn - 1]}
            assert now[-1] == {"role": "user", "content": conversation.turns[turn].prompt}
    systems = [c.system.split() for c in conversations]
    assert all(len(s) == 10 for s in systems)
    assert len({tuple(s[:4]) for s in systems}) == 1  # the shared prefix
    assert len({tuple(s[4:]) for s in systems}) == 5  # each its own


def test_multi_turn_shares_its_prefix_across_seeds_and_needs_chat():
    shared = spec("multi-turn", chat=True, shared_prefix_len=4)
    one, two = build_workload(shared, 1, seed=0), build_workload(shared, 1, seed=1)
    assert one[0].system.split()[:4] == two[0].system.split()[:4]
    assert one[0].system != two[0].system
    with pytest.raises(ValueError, match="--endpoint chat"):
        spec("multi-turn", chat=False)


def test_completion_prompts_are_ids_or_text_after_the_system_prompt():
    (conversation,) = build_workload(spec(), 1, seed=0)
    assert conversation.completion_prompt(0) == list(conversation.turns[0].prompt)
    with pytest.raises(TypeError, match="completions"):
        conversation.messages([])


def test_poisson_gaps_have_mean_one_over_the_rate():
    rate = 4.0
    offsets = arrival_offsets(20_000, rate, seed=5)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0 and offsets == arrival_offsets(20_000, rate, seed=5)
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    # exponential: P(gap > mean) = 1/e
    beyond = sum(g > 1 / rate for g in gaps) / len(gaps)
    assert beyond == pytest.approx(math.exp(-1), abs=0.015)
    assert arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_load_validates_and_names_itself():
    assert Load(2.0, 4).label == "rate 2/s, max concurrency 4"
    assert Load().label == "rate inf/s"
    with pytest.raises(ValueError, match="rate"):
        Load(0.0)
    with pytest.raises(ValueError, match="concurrency"):
        Load(1.0, 0)
