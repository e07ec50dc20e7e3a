"""A prefill engine hands a request's KV and first token to a decode engine, in one process,
through the engines' request states and KV connectors: the decode engine continues exactly as
a colocated engine would (greedy and seeded). The connectors here move the KV by gather and
scatter (`local_connectors`); over the transfer layer, see test_handoffs."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine_process.loop import _to_wire
from tests.conftest import random_prompts
from tests.unit.local_connectors import hand_off, pair

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def connectors(tiny_model_dirs):
    model = tiny_model_dirs("qwen3")
    engine_p = LLM(model, device="cpu", page_size=4).engine
    engine_d = LLM(model, device="cpu", page_size=4).engine
    prefill, decode = pair(engine_p, engine_d)
    return prefill, decode, model


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_handoff_by_gather_and_scatter_equals_colocated(connectors, params):
    """Seeded: the decode engine's draws continue where the prefill engine's left off (the
    first draw there is for the second output token), as in one colocated engine."""
    prefill, decode, model = connectors
    prompts = random_prompts((1, 5, 37), 1000, seed=8)
    expected = [o.token_ids for o in LLM(model, device="cpu").generate(prompts, params)]
    for i, prompt in enumerate(prompts):
        name = f"{params.seed}-r{i}"
        outputs = hand_off(prefill, decode, name, prompt, params, room=100 * i + 1)
        first = prefill.records[name].first_token
        assert outputs[0].new_token_ids == [first]
        assert [t for o in outputs for t in o.new_token_ids] == expected[i]
    assert prefill.engine.kv_pages_in_use == 0 and decode.engine.kv_pages_in_use == 0


def test_a_request_that_lands_with_an_impossible_record_fails_and_frees_its_pages(connectors):
    prefill, decode, _ = connectors
    decode.tamper = lambda record: dataclasses.replace(record, cached_tokens=10**6)
    outputs = hand_off(prefill, decode, "bad", list(range(10, 30)), GREEDY, room=7)
    assert outputs[-1].finished and outputs[-1].new_token_ids == []
    assert "could not join the batch" in outputs[-1].failure.message
    assert prefill.engine.kv_pages_in_use == 0 and decode.engine.kv_pages_in_use == 0


def test_a_request_that_ends_on_its_first_token_frees_its_pages(connectors):
    prefill, decode, _ = connectors
    one = dataclasses.replace(GREEDY, max_new_tokens=1)
    (output,) = hand_off(prefill, decode, "one", list(range(10, 18)), one, room=8)
    assert output.finished and output.finish_reason == "length"
    assert output.token_ids == [prefill.records["one"].first_token]
    assert decode.engine.kv_pages_in_use == 0 and prefill.engine.kv_pages_in_use == 0


def test_first_token_output_keeps_its_own_logprobs_after_the_next_step(connectors):
    """The decode engine reports the handed-over first token and then runs a step before the
    outputs go out (one loop turn): the first output must still carry the first token's
    logprob and top logprobs, not the second token's (they were slices taken too late)."""
    prefill, decode, _ = connectors
    (prompt,) = random_prompts((9,), 1000, seed=3)
    params = dataclasses.replace(GREEDY, max_new_tokens=4, logprobs=2)
    outputs = hand_off(prefill, decode, "lp", prompt, params, room=9)
    held = prefill.records["lp"]
    first, second = outputs[0], outputs[1]
    wire_first, wire_second = _to_wire(first), _to_wire(second)
    assert wire_first.new_logprobs == [held.first_logprob]
    assert dict(map(tuple, wire_first.new_top_logprobs[0])) == held.first_top_logprobs
    # Greedy: the chosen token heads its own top list.
    top = held.first_top_logprobs
    assert max(top, key=top.get) == held.first_token
    assert wire_second.new_logprobs == [second.logprobs[1]] != wire_first.new_logprobs
    assert decode.engine.kv_pages_in_use == 0
