"""Speculative decoding across prefill and decode, in one process over tcp (and once over
ipc, which writes the draft's KV into decode's pages too): the prefill side
runs the draft extend and ships the draft KV and seed metadata; the decode side rebuilds the
first draft input with the algorithm's hook. Every algorithm, chain and tree, is exactly the
target's greedy output; mismatched settings are refused at the handshake, naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve import LLM, SamplingParams
from pdserve.decode.connector import DecodeConnector
from pdserve.prefill.connector import PrefillConnector
from pdserve.protocol.spec_settings import SpecSettings
from tests.conftest import random_prompts
from tests.unit.disagg.test_handoffs import CONFIG, add, boot, drive, finished

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
CHAIN = {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
TREE = {"num_steps": 3, "eagle_topk": 2, "num_draft_tokens": 6}


@pytest.fixture(scope="module")
def drafts(spec_drafts):
    return spec_drafts


def engine(model, algorithm, draft, shape):
    settings = SpecSettings(algorithm, draft_model_path=draft, **shape)
    return LLM(model, device="cpu", page_size=4, speculative=settings).engine


def run_pair(prefill, decode, prompts):
    for i, prompt in enumerate(prompts):
        assert add(prefill, f"p{i}", prompt, GREEDY, boot(prefill, 100 + i)) is None
        assert add(decode, f"d{i}", prompt, GREEDY, boot(prefill, 100 + i)) is None
    names = [f"d{i}" for i in range(len(prompts))] + [f"p{i}" for i in range(len(prompts))]
    # NOTE: a generous deadline: two engines and two transfer threads share a 2-core CI box.
    return drive(prefill, decode, until=lambda o: all(finished(o, n) for n in names), deadline_s=90)


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE", "EAGLE", "EAGLE3"])
def test_disaggregated_speculation_is_exactly_the_targets(
    algorithm, shape, drafts, tiny_model_dirs
):
    assert_exactly_the_targets(algorithm, shape, drafts, tiny_model_dirs, CONFIG)


def test_draft_kv_written_straight_into_decodes_pages_is_exactly_the_targets(
    drafts, tiny_model_dirs
):
    """ipc: prefill writes the target's and the draft's KV into decode's two pools."""
    config = dataclasses.replace(CONFIG, backend="ipc")
    assert_exactly_the_targets("EAGLE3", TREE, drafts, tiny_model_dirs, config)


def assert_exactly_the_targets(algorithm, shape, drafts, tiny_model_dirs, config) -> None:
    model = tiny_model_dirs("llama")
    prompts = [*random_prompts((1, 6, 21), 250, seed=11), [7, 8, 9] * 5]
    expected = [o.token_ids for o in LLM(model, device="cpu").generate(prompts, GREEDY)]
    prefill = PrefillConnector(engine(model, algorithm, drafts[algorithm], shape), config)
    decode = DecodeConnector(engine(model, algorithm, drafts[algorithm], shape), config)
    try:
        outputs = run_pair(prefill, decode, prompts)
        for i, want in enumerate(expected):
            assert [t for o in outputs[f"d{i}"] for t in o.new_token_ids] == want, f"prompt {i}"
            assert outputs[f"d{i}"][-1].spec_verify_ct > 0
        assert prefill.engine.kv_pages_in_use == 0
        assert decode.engine.kv_pages_in_use == 0
        if algorithm != "NGRAM":
            assert len(prefill.transfer.stager.pools) == 2  # target and draft KV moved
    finally:
        prefill.stop()
        decode.stop()


def test_a_copy_draft_keeps_accepting_everything_after_the_handoff(tiny_model_dirs):
    """The draft KV and seed that crossed are right: a copy of the target accepts every
    drafted token from the first decode step on."""
    model = tiny_model_dirs("llama")
    shape = {"num_steps": 4, "eagle_topk": 1, "num_draft_tokens": 5}
    prefill = PrefillConnector(engine(model, "STANDALONE", model, shape), CONFIG)
    decode = DecodeConnector(engine(model, "STANDALONE", model, shape), CONFIG)
    try:
        outputs = run_pair(prefill, decode, random_prompts((5, 18), 250, seed=12))
        for name in ("d0", "d1"):
            last = outputs[name][-1]  # 12 tokens: 1 from prefill, then 5 + 5 + 1
            assert last.spec_verify_ct == 3 and last.spec_emitted_tokens == 11
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize(
    ("prefill_spec", "decode_spec", "field"),
    [
        (("EAGLE3", CHAIN), ("EAGLE3", {**TREE, "num_draft_tokens": 4}), "spec.topk"),
        (("NGRAM", CHAIN), None, "spec.algorithm"),
        (("EAGLE3", CHAIN), ("EAGLE", CHAIN), "spec.algorithm"),
    ],
)
def test_the_handshake_refuses_mismatched_speculation(
    prefill_spec, decode_spec, field, drafts, tiny_model_dirs
):
    model = tiny_model_dirs("llama")

    def build(spec):
        if spec is None:
            return LLM(model, device="cpu", page_size=4).engine
        algorithm, shape = spec
        return engine(model, algorithm, drafts[algorithm], shape)

    prefill = PrefillConnector(build(prefill_spec), CONFIG)
    decode = DecodeConnector(build(decode_spec), CONFIG)
    try:
        prompt = [5, 6, 7, 8]
        add(prefill, "p", prompt, GREEDY, boot(prefill, 7))
        add(decode, "d", prompt, GREEDY, boot(prefill, 7))
        outputs = drive(prefill, decode, until=lambda o: finished(o, "d") and finished(o, "p"))
        error = outputs["d"][-1].error
        assert error is not None and field in error, error
        assert prefill.engine.kv_pages_in_use == 0
        assert decode.engine.kv_pages_in_use == 0
    finally:
        prefill.stop()
        decode.stop()


def test_a_hook_that_returns_none_fails_the_room_not_the_worker(drafts, tiny_model_dirs):
    model = tiny_model_dirs("llama")
    prefill = PrefillConnector(engine(model, "NGRAM", None, CHAIN), CONFIG)
    decode = DecodeConnector(engine(model, "NGRAM", None, CHAIN), CONFIG)
    algorithm = decode.engine.speculator.algorithm
    algorithm.build_disagg_draft_input = lambda batch, last, records: [None]
    try:
        outputs = run_pair(prefill, decode, [[5, 6, 7, 8]])
        assert "returned None" in outputs["d0"][-1].error
        assert decode.engine.kv_pages_in_use == 0
    finally:
        prefill.stop()
        decode.stop()
