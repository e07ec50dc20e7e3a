"""Stop conditions, aborts, sampling reproducibility and request errors through the engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.checkpoint.model_config import UnsupportedModelError
from pdserve.engine.core.errors import InvalidRequestError, PromptTooLongError
from pdserve.engine.runtime.loader import KVCacheTooSmallError
from pdserve.engine.text.detokenizer import decode_text

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(tiny_model_dirs("llama"), device="cpu", max_model_len=256)


PROMPT = "The quick brown fox"


def greedy(n=32, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


class DecodeCounter:
    """A tokenizer that counts `decode` calls (everything else goes to the real one)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decodes = 0

    def decode(self, *args, **kwargs):
        self.decodes += 1
        return self.tokenizer.decode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_engine_decodes_only_for_stop_strings(llm, monkeypatch):
    counter = DecodeCounter(llm.engine.tokenizer)
    monkeypatch.setattr(llm.engine, "tokenizer", counter)  # LLM keeps its own for the text
    plain = llm.generate(PROMPT, greedy(12))[0]
    assert counter.decodes == 0
    assert plain.text == decode_text(llm.tokenizer, plain.token_ids)
    stopping = llm.generate(PROMPT, greedy(12, stop=["never in this text"]))[0]
    assert counter.decodes > 0
    assert stopping.token_ids == plain.token_ids and stopping.text == plain.text


def test_engine_outputs_carry_no_text(llm):
    llm.engine.add_request("token-level", PROMPT, greedy(3, stop=["x"]))
    outputs = [o for _ in range(3) for o in llm.engine.step()]
    assert outputs and all(o.text is None for o in outputs)
    llm.engine.abort_request("token-level")


def test_stop_string_straddling_tokens_truncates_text(llm):
    full = llm.generate(PROMPT, greedy())[0]
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids]
    # A stop string from the middle of token 3 into token 4 (tokens of >= 2 characters).
    start = next(i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 2 and pieces[i + 1])
    offset = sum(len(p) for p in pieces[:start]) + 1
    stop = full.text[offset : offset + len(pieces[start])]
    expected = full.text[: full.text.index(stop)]
    # The engine stops on the first token whose text completes the stop string...
    stop_at = next(
        n
        for n in range(1, len(full.token_ids) + 1)
        if stop in decode_text(llm.tokenizer, full.token_ids[:n])
    )
    out = llm.generate(PROMPT, greedy(stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[:stop_at]
    # ...and the text made outside it from those tokens is cut where the stop string begins.
    assert out.text == expected
    kept = llm.generate(PROMPT, greedy(stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.text == expected + stop


def test_stop_string_is_not_applied_before_min_new_tokens(llm):
    full = llm.generate(PROMPT, greedy())[0]
    stop = full.text[2:5]
    first = full.text.index(stop)
    early = llm.generate(PROMPT, greedy(stop=[stop]))[0]
    assert early.text == full.text[:first]
    late = llm.generate(PROMPT, greedy(stop=[stop], min_new_tokens=24))[0]
    assert len(late.token_ids) >= 24
    assert late.text.startswith(full.text[: first + len(stop)])  # the early match was kept


def test_stop_token_id_ends_generation(llm):
    full = llm.generate(PROMPT, greedy())[0]
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = llm.generate(PROMPT, greedy(stop_token_ids=[stop_id]))[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_stops_unless_ignored(tiny_model_dirs):
    llm = LLM(tiny_model_dirs("llama"), device="cpu", max_model_len=256)
    full = llm.generate(PROMPT, greedy())[0].token_ids
    # Declare the 4th generated token the EOS: a random model rarely emits the real one.
    eos = full[3]
    llm.engine.eos_token_ids = (eos,)
    llm.engine.sampler.eos_token_ids = (eos,)
    stopped = llm.generate(PROMPT, SamplingParams(max_new_tokens=32, temperature=0))[0]
    assert stopped.token_ids == full[: full.index(eos) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert llm.generate(PROMPT, greedy())[0].token_ids == full
    late = llm.generate(PROMPT, SamplingParams(max_new_tokens=32, temperature=0, min_new_tokens=8))
    assert eos not in late[0].token_ids[:8]


def test_min_new_tokens_and_max_new_tokens(llm):
    out = llm.generate(PROMPT, SamplingParams(max_new_tokens=7, min_new_tokens=7))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_seeded_sampling_reproduces_and_seeds_differ(llm):
    params = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=42)
    first = llm.generate([PROMPT], params)[0].token_ids
    crowd = llm.generate(["other prompt", PROMPT, "x"], params)[1].token_ids
    assert first == crowd
    other = llm.generate([PROMPT], SamplingParams(max_new_tokens=24, temperature=1.0, seed=7))
    assert other[0].token_ids != first


def test_context_length_caps_generation(tiny_model_dirs):
    small = LLM(tiny_model_dirs("llama"), device="cpu", max_model_len=20)
    out = small.generate([list(range(10, 25))], greedy(100))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_logprobs_are_reported_per_token(llm):
    out = llm.generate(PROMPT, greedy(6, logprobs=2))[0]
    assert len(out.logprobs) == 6 and len(out.top_logprobs) == 6
    for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert token == next(iter(top))  # greedy picks the top-1
        assert logprob == pytest.approx(top[token])


def test_abort_frees_pages_and_others_finish(llm):
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"abort-{i}", PROMPT, greedy(20))
    engine.step()
    engine.step()
    assert engine.kv_pages_in_use > 0
    assert engine.abort_request("abort-1")
    assert not engine.abort_request("abort-1")
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert sorted(finished) == ["abort-0", "abort-2"]
    assert engine.kv_pages_in_use == 0


@pytest.mark.parametrize(
    ("prompt", "params", "error", "match"),
    [
        ("", greedy(), InvalidRequestError, "empty"),
        ([5, 10**6], greedy(), InvalidRequestError, "outside the vocabulary"),
        ([5] * 256, greedy(), PromptTooLongError, "maximum context length is 256"),
    ],
)
def test_bad_requests_raise_clear_errors(llm, prompt, params, error, match):
    with pytest.raises(error, match=match):
        llm.generate([prompt], params)
    assert not llm.engine.has_unfinished()


def test_kv_cache_too_small_for_one_sequence_fails_at_start(tiny_model_dirs, llm):
    page_bytes = llm.engine.kv_pool.nbytes // llm.engine.kv_pool.num_pages
    with pytest.raises(KVCacheTooSmallError, match="less than one sequence of max_model_len=256"):
        LLM(tiny_model_dirs("llama"), device="cpu", max_model_len=256, kv_cache_memory=page_bytes)
    fits = LLM(
        tiny_model_dirs("llama"), device="cpu", max_model_len=64, kv_cache_memory=page_bytes * 4
    )
    out = fits.generate([[5] * 30, [6] * 40], greedy(34))
    assert [len(o.token_ids) for o in out] == [34, 24]
    assert fits.engine.kv_pages_in_use == 0


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match=r"LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(tmp_path), device="cpu")


def test_sharded_checkpoint_loads(tmp_path, tiny_model_dirs):
    from pdserve.synthetic.tiny_model import make_tiny_model

    sharded = make_tiny_model(tmp_path / "sharded", "qwen2", shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    reference = LLM(tiny_model_dirs("qwen2"), device="cpu").generate(PROMPT, greedy(8))
    assert (
        LLM(str(sharded), device="cpu").generate(PROMPT, greedy(8))[0].token_ids
        == reference[0].token_ids
    )


def test_cli_generate_prints_json(tiny_model_dirs):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "generate",
            "--prompt",
            "Hello",
            "--prompt",
            "Hi",
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--json",
            "--model-path",
            tiny_model_dirs("llama"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello", "Hi"]
    assert all(len(line["token_ids"]) == 5 for line in lines)


def test_generate_shows_a_progress_bar_only_on_a_terminal_or_when_asked(llm, capsys):
    prompts = [PROMPT, "Hello"]
    llm.generate(prompts, greedy(2))  # stderr is captured: not a terminal
    assert "Generating" not in capsys.readouterr().err
    llm.generate(prompts, greedy(2), use_tqdm=True)
    shown = capsys.readouterr().err
    assert "Generating" in shown and "2/2" in shown
    llm.generate(prompts, greedy(2), use_tqdm=False)
    assert capsys.readouterr().err == ""
