"""Overlap scheduling: each step launched before the previous one lands gives the tokens,
stops and outputs of plain stepping, one step later.

On CPU nothing runs asynchronously, but the bookkeeping is the same: placeholders in the
token lists, device-side resolution into the next step's inputs, stops found a step late.
"""

from __future__ import annotations

import pytest

from pdserve.engine.core.config import EngineConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.runtime.overlap import is_placeholder
from tests.conftest import random_prompts
from tests.unit.engine.runtime.test_decode_graphs import run

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


pytest.importorskip("triton")


@pytest.mark.parametrize("pages", [40, 9])
def test_overlapped_steps_give_the_tokens_of_plain_steps(tiny_model_dirs, pages):
    """Waves of requests (every graph bucket, padded batches and batches too large for a
    graph, prefill chunks beside decode tokens, a seeded request), with and without
    preemption (a recomputed prompt that ends in a placeholder)."""
    model = tiny_model_dirs("llama")
    plain, *_ = run(model, graphs=True, pages=pages, overlap=False)
    overlapped, engine, _, preemptions = run(model, graphs=True, pages=pages, overlap=True)
    assert overlapped == plain
    assert preemptions > 0 or pages == 40
    assert engine.in_flight is None and engine.kv_pages_in_use == 0


def engine(model_dir: str, overlap: bool) -> Engine:
    built = Engine(EngineConfig(model_path=model_dir, device="cpu", page_size=4))
    built.overlap = overlap
    return built


def drain(engine: Engine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def test_a_request_that_stops_emits_nothing_after_its_stop(tiny_model_dirs):
    """The step after a stop token already ran for the request: its token is dropped, the
    outputs and finish reasons are the plain ones, every placeholder is gone."""
    model = tiny_model_dirs("llama")
    prompts = random_prompts((5, 9, 3), 1000, seed=2)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    reference = engine(model, overlap=False)
    for i, prompt in enumerate(prompts):
        reference.add_request(str(i), prompt, greedy)
    full = {k: v[-1].token_ids for k, v in drain(reference).items()}
    results = {}
    for overlap in (False, True):
        e = engine(model, overlap)
        for i, prompt in enumerate(prompts):
            # Each request stops on its own 4th, 7th or 10th token.
            stop = full[str(i)][3 + 3 * i]
            params = SamplingParams(
                max_new_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop]
            )
            e.add_request(str(i), prompt, params)
        outputs = drain(e)
        results[overlap] = {
            k: ([t for o in v for t in o.new_token_ids], v[-1].finish_reason, v[-1].token_ids)
            for k, v in outputs.items()
        }
        assert e.kv_pages_in_use == 0
    assert results[True] == results[False]
    for new, reason, tokens in results[True].values():
        assert reason == "stop" and new == tokens and not any(map(is_placeholder, tokens))


def test_an_abort_while_a_step_is_in_flight_drops_its_token(tiny_model_dirs):
    e = engine(tiny_model_dirs("llama"), overlap=True)
    prompt = random_prompts((6,), 1000, seed=4)[0]
    e.add_request("a", prompt, SamplingParams(max_new_tokens=20, temperature=0))
    e.add_request("b", prompt, SamplingParams(max_new_tokens=4, temperature=0))
    for _ in range(3):
        e.step()
    assert e.in_flight is not None and e.requests["a"] in e.in_flight.requests
    assert e.abort_request("a")
    outputs = drain(e)
    assert "a" not in outputs
    assert outputs["b"][-1].finished and len(outputs["b"][-1].token_ids) == 4
    assert e.kv_pages_in_use == 0


def test_logprobs_and_penalties_step_without_overlap(tiny_model_dirs):
    """Requests whose tokens need the host at once (logprobs, penalties) turn overlap off
    for as long as they are live; landing the in-flight step first keeps every token."""
    model = tiny_model_dirs("llama")
    prompts = random_prompts((4, 7), 1000, seed=6)
    plain_params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    logprob_params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    tokens = {}
    for overlap in (False, True):
        e = engine(model, overlap)
        e.add_request("plain", prompts[0], plain_params)
        e.step()
        e.step()
        e.add_request("logprobs", prompts[1], logprob_params)
        assert not e._overlaps()
        outputs = drain(e)
        tokens[overlap] = {k: v[-1].token_ids for k, v in outputs.items()}
        assert len(outputs["logprobs"][-1].logprobs) == 8
        assert e._overlaps() == overlap, "overlap stays off after the request that needed it"
    assert tokens[True] == tokens[False]


def test_chunked_prompts_beside_overlapped_decoding(tiny_model_dirs):
    """Steps whose chunks sample nothing, and prompts admitted while others decode."""
    model = tiny_model_dirs("qwen3")
    prompts = random_prompts((9, 13, 2, 6), 1000, seed=8)
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    tokens = {}
    for overlap in (False, True):
        e = Engine(
            EngineConfig(model_path=model, device="cpu", page_size=4, chunked_prefill_size=4)
        )
        e.overlap = overlap
        e.add_request("0", prompts[0], params)
        e.add_request("1", prompts[1], params)
        outputs = {}
        for step in range(40):
            if step == 3:
                e.add_request("2", prompts[2], params)
                e.add_request("3", prompts[3], params)
            for output in e.step():
                outputs[output.request_id] = output.token_ids
            if step > 3 and not e.has_unfinished():
                break
        tokens[overlap] = outputs
        assert e.kv_pages_in_use == 0
    assert tokens[True] == tokens[False]
    assert all(len(t) == 6 for t in tokens[True].values())
