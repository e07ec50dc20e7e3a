"""Shared fixtures: tiny seeded models (one per architecture) and the transformers reference."""

from __future__ import annotations

import os

import torch

# NOTE: without a GPU, Triton kernels are tested under Triton's interpreter; it must be on
# before any kernel module is imported (triton.jit reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """Callable arch -> directory of a seeded tiny model, built once per session."""
    from pdserve.synthetic.tiny_model import make_tiny_model

    cache: dict[str, str] = {}

    def get(arch: str = "llama") -> str:
        if arch not in cache:
            cache[arch] = str(make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def spec_drafts(tiny_model_dirs, tmp_path_factory):
    """--speculative-draft-model-path per built-in algorithm for the tiny llama target: seeded
    random drafts (verification keeps any draft's output exact). The EAGLE-3 draft is
    narrower than the target (32 vs 64), has two layers, per-layer fc_norm, legacy `midlayer`
    names and a reduced vocabulary with d2t; STANDALONE drafts with a copy of the target."""
    from pdserve.speculative.checkpoints import make_tiny_eagle_draft

    target = tiny_model_dirs("llama")
    root = tmp_path_factory.mktemp("drafts")
    return {
        "NGRAM": None,
        "STANDALONE": target,
        "EAGLE": str(make_tiny_eagle_draft(root / "eagle", target, eagle3=False)),
        "EAGLE3": str(
            make_tiny_eagle_draft(
                root / "eagle3",
                target,
                aux_layer_ids=[1, 0],
                hidden_size=32,
                num_layers=2,
                fc_norm=True,
                legacy_midlayer=True,
                draft_vocab_ids=list(range(0, 1000, 3)),
            )
        ),
    }


@pytest.fixture(scope="session")
def hf_greedy():
    """Callable (model_dir, prompt_ids, n, device, dtype) -> transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    models: dict[tuple, torch.nn.Module] = {}

    def generate(model_dir, prompt_ids, n, device="cpu", dtype=torch.float32):
        key = (model_dir, device, dtype)
        if key not in models:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
            # Generate exactly n tokens, like the engine with ignore_eos.
            model.generation_config.eos_token_id = None
            models[key] = model
        model = models[key]
        ids = torch.tensor([prompt_ids], device=device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        return out[0, len(prompt_ids) :].tolist()

    return generate


def random_prompts(lengths, vocab_size, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct as a Q4_1 GGUF file (tests/real_models.py): fetched once into
    pdserve's cache; the test skips where it cannot be fetched."""
    from tests.real_models import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf):
    """The GGUF file converted to a model directory, as `--model-path x.gguf` converts it
    (once, into pdserve's cache, where launched workers find it too)."""
    from pdserve.engine.checkpoint.model_files import resolve_model_dir

    return resolve_model_dir(str(smollm2_gguf))
