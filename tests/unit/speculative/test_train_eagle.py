"""`pdserve train-eagle`: its training-time-test unroll computes exactly what drafting
computes at inference (same masks, positions and recurrent hidden states), and the directory
it writes is served by the engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.runtime.attention import AttentionContext
from pdserve.engine.runtime.kv_pool import KVPool
from pdserve.protocol.spec_settings import SpecSettings
from pdserve.speculative.checkpoints import build_draft_model, eagle_draft_config
from pdserve.speculative.training.train_eagle import _capture, ttt_logits
from tests.conftest import random_prompts

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


@torch.no_grad()
def test_the_ttt_unroll_equals_chain_drafting_at_inference(tiny_model_dirs):
    engine = LLM(tiny_model_dirs("llama"), device="cpu", page_size=4).engine
    target = engine.model_config
    config = eagle_draft_config(target, aux_layer_ids=[1, 0], hidden_size=32, num_kv_heads=2)
    torch.manual_seed(0)
    model = build_draft_model(config, target).eval()
    tokens = torch.tensor(random_prompts((14,), 250, seed=3))
    features, _ = _capture(engine, tokens, (1, 0))
    unrolled = ttt_logits(model, tokens, features, steps=3)[:, 0]  # [steps, T - 1, V]

    pool = KVPool(
        num_layers=1, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    pages = list(range(8))
    anchor = 6  # the draft has real target features up to here, then drafts a chain

    def forward(ids, start, hidden, from_target):
        ctx = AttentionContext.build(
            page_size=4, pages=[pages], num_computed=[start], query_lens=[len(ids)],
            device=torch.device("cpu"),
        )  # fmt: skip
        return model(torch.tensor(ids), ctx.positions, hidden, from_target, pool, ctx)

    x = tokens[0].tolist()
    out = forward(x[1 : anchor + 2], 0, features[0, : anchor + 1], True)
    assert torch.allclose(model.compute_logits(out), unrolled[0, : anchor + 1], atol=1e-4)
    hidden = out[-1:]
    for step in (1, 2):
        position = anchor + step
        hidden = forward([x[position + 1]], position, hidden, False)
        assert torch.allclose(model.compute_logits(hidden)[0], unrolled[step, position], atol=1e-4)


def test_train_eagle_writes_a_draft_the_engine_serves(tiny_model_dirs, tmp_path):
    target = tiny_model_dirs("llama")
    out = tmp_path / "draft"
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "train-eagle", "--model-path", target,
         "--out", str(out), "--num-sequences", "12", "--gen-len", "12", "--steps", "20",
         "--batch-size", "4", "--aux-layers", "1", "0", "--draft-vocab-size", "64",
         "--device", "cpu"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["held_out_accuracy_per_step"]) == 4
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] <= 64
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 0]
    settings = SpecSettings("EAGLE3", str(out), num_steps=3, eagle_topk=1, num_draft_tokens=4)
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    prompts = random_prompts((4, 9), 250, seed=13)
    plain = LLM(target, device="cpu").generate(prompts, params)
    spec = LLM(target, device="cpu", speculative=settings).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_bad_training_settings_are_refused():
    from pdserve.speculative.training.train_eagle import TrainConfig

    with pytest.raises(ValueError, match="ttt-steps"):
        TrainConfig("m", "o", ttt_steps=0)
    with pytest.raises(ValueError, match="num-sequences"):
        TrainConfig("m", "o", num_sequences=1)
    with pytest.raises(ValueError, match="--sequences-file"):
        TrainConfig("m", "o", steps=0)


def test_sampled_answers_and_a_sequences_file_that_a_later_run_trains_from(
    tiny_model_dirs, tmp_path, monkeypatch
):
    from pdserve.speculative.training import train_eagle as module
    from pdserve.speculative.training.train_eagle import TrainConfig, load_sequences, train_eagle

    target = tiny_model_dirs("llama")
    stored = tmp_path / "sequences.safetensors"
    settings = {
        "model_path": target,
        "num_sequences": 4,
        "prompt_len": 6,
        "gen_len": 10,
        "answers_per_prompt": 3,
        "sequences_file": str(stored),
        "batch_size": 2,
        "aux_layer_ids": (1, 0),
        "draft_vocab_size": 64,
        "device": "cpu",
    }
    # steps 0: generate and store the sequences, train nothing
    generated = train_eagle(TrainConfig(out_dir=str(tmp_path / "first"), steps=0, **settings))
    assert generated.out_dir == stored and not (tmp_path / "first").exists()
    sequences = load_sequences(stored)
    assert sequences.answers_per_prompt == 3 and len(sequences.tokens) == 12
    rows = sequences.tokens.tolist()
    prompts = [rows[3 * i][:6] for i in range(4)]
    assert all(rows[3 * i + k][:6] == prompts[i] for i in range(4) for k in range(3))
    greedy = LLM(target, device="cpu").generate(
        prompts, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    )
    assert [rows[3 * i][6:] for i in range(4)] == [o.token_ids for o in greedy]
    sampled = [rows[3 * i + k][6:] for i in range(4) for k in (1, 2)]
    assert any(s != rows[3 * (j // 2)][6:] for j, s in enumerate(sampled)), "nothing sampled"

    def no_generation(*args, **kwargs):
        raise AssertionError("generated again despite the sequences file")

    monkeypatch.setattr(module, "_generate", no_generation)
    report = train_eagle(TrainConfig(out_dir=str(tmp_path / "second"), steps=2, **settings))
    assert len(report.eval_accuracy) == 4
    assert (tmp_path / "second" / "config.json").is_file()


def test_a_sequences_file_that_does_not_fit_the_target_is_refused(tiny_model_dirs, tmp_path):
    from pdserve.speculative.training.train_eagle import (
        Sequences,
        TrainConfig,
        save_sequences,
        train_eagle,
    )

    target = tiny_model_dirs("llama")
    foreign = tmp_path / "foreign.safetensors"
    tokens = torch.tensor([[1, 2, 3, 10**6], [1, 2, 3, 4]])  # an id past the vocabulary
    save_sequences(Sequences(tokens, [2, 2], [4, 4]), foreign)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    for path, message in ((foreign, "outside the target's vocabulary"), (junk, "not a sequences")):
        config = TrainConfig(
            target, str(tmp_path / "out"), sequences_file=str(path), device="cpu", steps=1
        )
        with pytest.raises(ValueError, match=message) as refused:
            train_eagle(config)
        assert str(path) in str(refused.value)
