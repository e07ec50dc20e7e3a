"""Speculative decoding in the engine: every algorithm, chain and tree, is lossless against the
target alone; rejected KV goes back to the allocator; drafts of other widths, plugins, limits,
stops, logprobs and bad configurations."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.core.page_allocator import pages_needed
from pdserve.engine.text.detokenizer import decode_text
from pdserve.protocol.metadata_spec import MetadataSpec
from pdserve.protocol.spec_settings import SpecSettings
from pdserve.speculative import registry
from pdserve.speculative.algorithm import Capabilities, SpeculativeAlgorithm
from pdserve.speculative.checkpoints import make_tiny_eagle_draft
from pdserve.speculative.state import DraftBatch
from pdserve.speculative.tree import DraftTree
from tests.conftest import random_prompts

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
LENGTHS = (1, 5, 17, 40)
CHAIN = {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
TREE = {"num_steps": 3, "eagle_topk": 3, "num_draft_tokens": 8}


@pytest.fixture(scope="module")
def drafts(spec_drafts):
    return spec_drafts


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    llm = LLM(tiny_model_dirs("llama"), device="cpu", page_size=4)
    prompts = random_prompts(LENGTHS, 1000, seed=5)
    # A repetitive prompt gives NGRAM something to match.
    prompts.append([11, 12, 13, 14] * 6)
    return prompts, [o.token_ids for o in llm.generate(prompts, GREEDY)]


def spec_llm(model_dir, algorithm, draft, shape, **options):
    settings = SpecSettings(algorithm, draft_model_path=draft, **shape)
    return LLM(model_dir, device="cpu", page_size=4, speculative=settings, **options)


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE", "EAGLE", "EAGLE3"])
def test_greedy_output_is_exactly_the_targets(algorithm, shape, drafts, reference, tiny_model_dirs):
    prompts, expected = reference
    llm = spec_llm(tiny_model_dirs("llama"), algorithm, drafts[algorithm], shape)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.spec_verify_ct > 0 for o in outputs)
    assert llm.engine.kv_pages_in_use == 0


@pytest.mark.parametrize("algorithm", ["STANDALONE", "EAGLE3"])
def test_chunked_prefill_and_preemption_stay_exact(algorithm, drafts, reference, tiny_model_dirs):
    """Draft extends per prefill chunk; a preempted request recomputes its draft state."""
    prompts, expected = reference
    llm = spec_llm(
        tiny_model_dirs("llama"),
        algorithm,
        drafts[algorithm],
        TREE,
        chunked_prefill_size=8,
        kv_cache_memory=page_bytes(tiny_model_dirs, algorithm, drafts[algorithm]) * 28,
        max_model_len=96,
    )
    engine = llm.engine
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, GREEDY)
    final, preempted = {}, 0
    while engine.has_unfinished():
        preempted = max(preempted, sum(r.num_preemptions for r in engine.scheduler.waiting))
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output.token_ids
    assert [final[i] for i in ids] == expected
    assert preempted > 0, "the KV budget was meant to force a preemption"
    assert engine.kv_pages_in_use == 0


def page_bytes(tiny_model_dirs, algorithm, draft):
    """Bytes of one page of 4 tokens, target and draft KV."""
    engine = spec_llm(tiny_model_dirs("llama"), algorithm, draft, TREE).engine
    pool = engine.kv_pool
    return pool.nbytes // pool.num_pages + engine.speculator.draft_page_bytes()


def test_a_copy_of_the_target_as_standalone_draft_accepts_every_token(tiny_model_dirs, reference):
    prompts, expected = reference
    model_dir = tiny_model_dirs("llama")
    llm = spec_llm(
        model_dir, "STANDALONE", model_dir, {**CHAIN, "num_steps": 4, "num_draft_tokens": 5}
    )
    params = SamplingParams(max_new_tokens=21, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for output, want in zip(outputs, expected, strict=True):
        assert output.token_ids == want[:21]
        # The first token comes from the prefill; every verify step emits num_steps + 1.
        assert output.spec_verify_ct == 4 and output.spec_emitted_tokens == 20


def test_pages_past_the_accepted_tokens_are_freed_every_step(tiny_model_dirs, drafts):
    llm = spec_llm(tiny_model_dirs("llama"), "EAGLE", drafts["EAGLE"], TREE)
    engine = llm.engine
    for i, prompt in enumerate(random_prompts((9, 30), 1000, seed=8)):
        engine.add_request(str(i), prompt, GREEDY)
    while engine.has_unfinished():
        engine.step()
        for request in engine.scheduler.running:
            if request.draft_state is not None:
                assert len(request.pages) == pages_needed(request.num_tokens, 4)
    assert engine.kv_pages_in_use == 0


def test_token_limits_stops_and_logprobs_match_the_target(tiny_model_dirs, drafts, reference):
    prompts, expected = reference
    model_dir = tiny_model_dirs("llama")
    plain = LLM(model_dir, device="cpu", page_size=4)
    llm = spec_llm(model_dir, "STANDALONE", model_dir, TREE)
    short = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, short)] == [e[:5] for e in expected]
    stop_at = expected[4][6]  # a token the target emits mid-stream: the stream must end there
    stopping = SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=[stop_at])
    got = llm.generate(prompts, stopping)
    want = plain.generate(prompts, stopping)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[4].finish_reason == "stop" and got[4].token_ids[-1] == stop_at
    # A stop string: several tokens per verify step reach the detokenizers (the engine's and
    # the one making the text) in one output; both must stop where the target alone stops.
    full = decode_text(plain.tokenizer, expected[4])
    start = next(i for i in range(len(full) // 3, len(full)) if full[i : i + 3].isalnum())
    stop = full[start : start + 3]
    by_string = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    got, want = llm.generate(prompts, by_string), plain.generate(prompts, by_string)
    assert [(o.token_ids, o.text) for o in got] == [(o.token_ids, o.text) for o in want]
    assert got[4].stop_reason == stop and got[4].text == full[: full.index(stop)]
    with_logprobs = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    got = llm.generate(prompts, with_logprobs)
    want = plain.generate(prompts, with_logprobs)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4)
        assert [sorted(t) for t in g.top_logprobs] == [sorted(t) for t in w.top_logprobs]


def test_seeded_sampling_runs_and_reproduces(tiny_model_dirs, drafts):
    llm = spec_llm(tiny_model_dirs("llama"), "EAGLE3", drafts["EAGLE3"], TREE)
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    prompts = random_prompts((6, 12), 1000, seed=9)
    first = [o.token_ids for o in llm.generate(prompts, params)]
    again = [o.token_ids for o in llm.generate(prompts, params)]
    assert first == again and all(len(t) == 16 for t in first)
    assert llm.engine.kv_pages_in_use == 0


def test_seeded_tokens_do_not_depend_on_where_a_batchs_chunks_end(tiny_model_dirs, drafts):
    """With 8-token chunks, the second prompt (7 tokens) is prefilled 7 - 1 tokens beside
    the first one's tail and then has one prompt token left, with a draft state already: its
    first token must still be drawn as when it runs alone (by the sampler at position 0,
    not by a tree verification), so that seeded output is the same in any batch."""
    llm = spec_llm(tiny_model_dirs("llama"), "EAGLE3", drafts["EAGLE3"], TREE,
                   chunked_prefill_size=8)  # fmt: skip
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    prompts = random_prompts((10, 7), 1000, seed=2)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


def test_standalone_draft_of_another_width_including_empty_batches(tiny_model_dirs, tmp_path):
    """Target hidden size 64, draft 32: no hidden state crosses, nothing is sized from the
    target; empty batches pass through every hook."""
    from pdserve.synthetic.tiny_model import make_tiny_model

    target = tiny_model_dirs("llama")
    draft = make_tiny_model(tmp_path / "draft", "llama", hidden_size=32, num_heads=2, seed=3)
    llm = spec_llm(target, "STANDALONE", str(draft), TREE)
    engine, algorithm = llm.engine, llm.engine.speculator.algorithm
    assert engine.model_config.hidden_size == 64 and algorithm.config.hidden_size == 32
    assert engine.step() == []  # idle
    assert algorithm.extend([]) == [] and algorithm.propose([]) == []
    spec = algorithm.metadata_spec(algorithm.draft_config(), "float32")
    assert spec.hidden_size is None and spec.topk == 3
    batch = DraftBatch([], spec, torch.device("cpu"))
    assert algorithm.build_disagg_draft_input(batch, [], []) == []
    prompts = random_prompts((3, 19), 1000, seed=4)
    plain = LLM(target, device="cpu", page_size=4).generate(prompts, GREEDY)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [o.token_ids for o in plain]
    assert all(r.draft_state is None for r in engine.scheduler.running)


def test_hc_mult_doubles_the_hidden_width_that_crosses(drafts):
    eagle = registry.get("EAGLE3")(SpecSettings("EAGLE3", drafts["EAGLE3"], **CHAIN))
    config = eagle.draft_config()
    assert eagle.metadata_spec(config, "bfloat16").hidden_size == 32
    assert eagle.metadata_spec({**config, "hc_mult": 2}, "bfloat16").hidden_size == 64


class RepeatLast(SpeculativeAlgorithm):
    """A third-party algorithm: proposes the last token again, num_steps times."""

    name = "TEST_REPEAT_LAST"
    capabilities = Capabilities(has_draft_kv=False, carries_hidden=False, seeds_topk=False)

    def propose(self, requests):
        return [DraftTree.chain([r.token_ids[-1]] * self.settings.num_steps) for r in requests]

    def build_disagg_draft_input(self, batch, last_tokens, records):
        from pdserve.speculative.algorithm import draft_states_from_records

        return draft_states_from_records(self, batch, last_tokens, records)


def test_a_plugin_registered_by_decorator_serves_requests(tiny_model_dirs, reference):
    registry.register(RepeatLast)
    try:
        prompts, expected = reference
        llm = spec_llm(tiny_model_dirs("llama"), "TEST_REPEAT_LAST", None, CHAIN)
        outputs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outputs] == expected
    finally:
        registry.unregister("TEST_REPEAT_LAST")


def test_a_plugin_that_proposes_too_much_is_stopped_with_a_clear_error(tiny_model_dirs):
    class Greedy(RepeatLast):
        name = "TEST_TOO_MANY"

        def propose(self, requests):
            return [DraftTree.chain([1] * 9) for _ in requests]

    registry.register(Greedy)
    try:
        llm = spec_llm(tiny_model_dirs("llama"), "TEST_TOO_MANY", None, CHAIN)
        with pytest.raises(RuntimeError, match="proposed 9 tokens"):
            llm.generate([[1, 2, 3]], GREEDY)
    finally:
        registry.unregister("TEST_TOO_MANY")


def test_speculative_settings_without_a_speculator_are_refused(tiny_model_dirs):
    from pdserve.engine.core.config import EngineConfig
    from pdserve.engine.engine import Engine

    settings = SpecSettings("NGRAM", **CHAIN)
    config = EngineConfig(tiny_model_dirs("llama"), device="cpu", speculative=settings)
    with pytest.raises(ValueError, match="need a speculator"):
        Engine(config)


def test_a_plugin_capture_that_is_not_a_capture_is_named(tiny_model_dirs):
    class OldCapture(RepeatLast):
        name = "TEST_OLD_CAPTURE"

        def target_capture(self):
            return "final"

    registry.register(OldCapture)
    try:
        with pytest.raises(TypeError, match="returned 'final'; return a Capture"):
            spec_llm(tiny_model_dirs("llama"), "TEST_OLD_CAPTURE", None, CHAIN)
    finally:
        registry.unregister("TEST_OLD_CAPTURE")


def test_bad_configurations_fail_at_start_with_the_reason(tiny_model_dirs, drafts, tmp_path):
    model_dir = tiny_model_dirs("llama")
    cases = [
        ("EAGLE", None, "needs --speculative-draft-model-path"),
        ("NGRAM", drafts["EAGLE"], "drop --speculative-draft-model-path"),
        ("EAGLE", drafts["EAGLE3"], "needs a LlamaForCausalLMEagle draft"),
        ("EAGLE3", drafts["EAGLE"], "needs a LlamaForCausalLMEagle3 draft"),
        ("NOPE", None, "unknown speculative algorithm 'NOPE'"),
    ]
    for algorithm, draft, message in cases:
        with pytest.raises((ValueError, KeyError), match=message):
            spec_llm(model_dir, algorithm, draft, CHAIN)
    # Default EAGLE-3 capture layers [2, L // 2, L - 3] do not exist in a 2-layer target.
    no_ids = make_tiny_eagle_draft(tmp_path / "no_ids", model_dir, aux_layer_ids=[0, 1])
    config = json.loads((no_ids / "config.json").read_text())
    del config["eagle_config"]
    (no_ids / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        spec_llm(model_dir, "EAGLE3", str(no_ids), CHAIN)
    narrow = make_tiny_eagle_draft(
        tmp_path / "narrow", model_dir, aux_layer_ids=[0], hidden_size=32
    )
    config = json.loads((narrow / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLMEagle"]
    (narrow / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden sizes must match"):
        spec_llm(model_dir, "EAGLE", str(narrow), CHAIN)


def test_a_d2t_map_outside_the_target_vocabulary_is_refused_at_load(tiny_model_dirs, tmp_path):
    """Drafted ids reach the target's embedding unchecked, so the draft -> target map is
    checked once, when the draft loads."""
    from safetensors.torch import load_file, save_file

    model_dir = tiny_model_dirs("llama")
    draft = make_tiny_eagle_draft(
        tmp_path / "d2t", model_dir, aux_layer_ids=[1, 0], draft_vocab_ids=list(range(0, 1000, 4))
    )
    (weights,) = draft.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["d2t"][-1] += 4  # the last draft id now maps to target id 1000 of 1000
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=r"d2t maps 1 draft ids outside .*\[0, 1000\)"):
        spec_llm(model_dir, "EAGLE3", str(draft), CHAIN)


def test_eagle3_reads_num_aux_and_norm_keys(tiny_model_dirs, tmp_path):
    from pdserve.engine.checkpoint.model_config import ModelConfig
    from pdserve.engine.runtime.models.eagle import EagleConfig
    from pdserve.speculative.checkpoints import eagle_draft_config

    target = ModelConfig.from_pretrained(tiny_model_dirs("llama"))
    deep = ModelConfig.from_dict({**target.hf_config, "num_hidden_layers": 12})
    base = eagle_draft_config(deep)
    assert EagleConfig.from_dict(base, deep).aux_layer_ids == (2, 6, 9)
    two = {**base, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 10]}}
    parsed = EagleConfig.from_dict(two, deep)
    assert parsed.aux_layer_ids == (1, 10) and parsed.capture_width == 2 * 64
    with pytest.raises(ValueError, match="num_aux_hidden_states 3 != 2"):
        EagleConfig.from_dict({**two, "num_aux_hidden_states": 3}, deep)
    with pytest.raises(ValueError, match="num_aux_hidden_states is 2"):
        EagleConfig.from_dict({**base, "num_aux_hidden_states": 2}, deep)
    assert EagleConfig.from_dict({**base, "use_aux_norm": True}, deep).fc_norm
    assert EagleConfig.from_dict({**base, "fc_norm": True}, deep).fc_norm


def test_metadata_for_a_disaggregated_start_is_checked(drafts):
    eagle = registry.get("EAGLE")(SpecSettings("EAGLE", drafts["EAGLE"], **TREE))
    spec = MetadataSpec(topk=3, hidden_size=64, hidden_dtype="float32")
    batch = DraftBatch(["r1"], spec, torch.device("cpu"))

    class Record:
        topk_p = torch.full((3,), 1 / 3)
        topk_index = torch.tensor([1, 2, 3])
        hidden_states = torch.zeros(64)

    states = eagle.build_disagg_draft_input(batch, [5], [Record()])
    assert states[0].hidden.shape == (64,) and states[0].topk_index.tolist() == [1, 2, 3]
    missing = Record()
    missing.hidden_states = None
    with pytest.raises(ValueError, match="no hidden_states"):
        eagle.build_disagg_draft_input(batch, [5], [missing])
    wide = Record()
    wide.hidden_states = torch.zeros(128)
    with pytest.raises(ValueError, match="width 128 != spec_hidden_size 64"):
        eagle.build_disagg_draft_input(batch, [5], [wide])
    few = Record()
    few.topk_p = torch.ones(2)
    with pytest.raises(ValueError, match="topk_p has 2 entries"):
        eagle.build_disagg_draft_input(batch, [5], [few])
    with pytest.raises(ValueError, match="must match one to one"):
        eagle.build_disagg_draft_input(batch, [5, 6], [Record()])


def test_a_hyper_connection_draft_is_refused_by_name(drafts, tiny_model_dirs, tmp_path):
    import shutil

    wide = tmp_path / "hc"
    shutil.copytree(drafts["EAGLE3"], wide)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "hc_mult": 2}))
    with pytest.raises(ValueError, match="hyper-connections"):
        spec_llm(tiny_model_dirs("llama"), "EAGLE3", str(wide), CHAIN)
