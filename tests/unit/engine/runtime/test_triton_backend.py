"""The Triton attention backend against the torch reference: one mixed step (decode tokens,
prefill chunks after a cached prefix, a tree-masked sequence), whole engines of every tiny
architecture, speculative verification on it, and how the backend is chosen.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.runtime.attention import AttentionContext, TorchReferenceBackend
from pdserve.engine.runtime.attention.select import (
    AttentionBackendUnavailableError,
    make_attention_backend,
)
from pdserve.engine.runtime.kv_pool import KVPool
from pdserve.engine.runtime.models.layers import RotaryEmbedding
from pdserve.protocol.spec_settings import SpecSettings
from tests.conftest import ARCHS, random_prompts

pytest.importorskip("triton")

from pdserve.engine.runtime.attention.triton_backend import TritonBackend

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# float32 on either device: greedy paths of two bf16 implementations may part at near-ties.
# A small KV pool: on a GPU the default takes 85% of its memory, which an engine not yet
# collected would hold against the next test that sizes its pool from free memory.
ENGINE = {"device": DEVICE.type, "dtype": "float32", "kv_cache_memory": 256 << 20}
GREEDY = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)


def mixed_step(generator):
    """A step of five sequences: two decoding, a fresh prompt, a chunk after a prefix, and a
    tree verified under an explicit mask; pages in scattered order."""
    page_size = 4
    num_computed = [9, 0, 6, 12, 3]
    query_lens = [1, 7, 5, 4, 1]
    order = torch.randperm(40, generator=generator).tolist()
    pages = []
    for computed, new in zip(num_computed, query_lens, strict=True):
        count = -(-(computed + new) // page_size)
        pages.append(order[:count])
        order = order[count:]
    # A tree over the last 4 keys (the 12 cached ones are visible).
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    positions = [list(range(c, c + q)) for c, q in zip(num_computed, query_lens, strict=True)]
    positions[3] = [12, 13, 13, 14]  # tree nodes sit at their depth
    return AttentionContext.build(
        page_size=page_size,
        pages=pages,
        num_computed=num_computed,
        query_lens=query_lens,
        device=DEVICE,
        positions=positions,
        masks={3: tree},
    )


def test_every_metadata_tensor_starts_16_bytes_aligned():
    """Triton compiles a kernel variant per pointer alignment: a view at an odd offset of the
    one packed copy would compile new variants at serve time."""
    ctx = mixed_step(torch.Generator().manual_seed(1))  # five sequences: odd-length parts
    tensors = {
        name: value
        for name, value in vars(ctx).items()
        if isinstance(value, torch.Tensor) and value.dtype == torch.int64
    }
    assert len(tensors) >= 12
    assert {name: t.data_ptr() % 16 for name, t in tensors.items()} == dict.fromkeys(tensors, 0)


@pytest.mark.parametrize("window", [None, 5])
def test_a_mixed_step_matches_the_reference(window):
    generator = torch.Generator().manual_seed(0)
    ctx = mixed_step(generator)
    if window is not None:
        # The engine refuses speculation with sliding windows: no masks then.
        ctx.masks = ctx.mask_data = ctx.mask_offsets = ctx.mask_widths = None
    heads, kv_heads, head_dim = 8, 2, 32
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    with torch.device(DEVICE):
        rotary = RotaryEmbedding(inv_freq, 1.0, 64)
    pools = []
    for _ in range(2):
        pool = KVPool(
            num_layers=1,
            num_pages=40,
            page_size=4,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=torch.float32,
            device=DEVICE,
        )
        # The same random history in both pools; new tokens overwrite their slots.
        pool.storage.copy_(torch.randn(pool.storage.shape, generator=generator))
        pools.append(pool)
    pools[1].storage.copy_(pools[0].storage)
    tokens = ctx.num_tokens
    q = torch.randn(tokens, heads, head_dim, generator=generator).to(DEVICE)
    k = torch.randn(tokens, kv_heads, head_dim, generator=generator).to(DEVICE)
    v = torch.randn(tokens, kv_heads, head_dim, generator=generator).to(DEVICE)
    backends = (TorchReferenceBackend(), TritonBackend(DEVICE))
    outs = [
        backend.forward(
            0,
            q.clone(),
            k.clone(),
            v.clone(),
            ctx.positions,
            pool,
            ctx,
            rotary=rotary,
            scale=head_dim**-0.5,
            sliding_window=window,
        )
        for backend, pool in zip(backends, pools, strict=True)
    ]
    torch.testing.assert_close(pools[1].storage, pools[0].storage, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def prompts():
    # Lengths around the page size (4): shorter, exactly one page, several pages.
    return random_prompts((1, 4, 9, 23), 1000, seed=3)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_equals_the_torch_backend(arch, tiny_model_dirs, prompts):
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_model_dirs(arch), page_size=4, attention_backend=backend, **ENGINE)
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.engine.kv_pages_in_use == 0
    assert outputs["triton"] == outputs["torch"]


def test_tree_verification_on_triton_stays_lossless(tiny_model_dirs, spec_drafts, prompts):
    target = tiny_model_dirs("llama")
    expected = [
        o.token_ids for o in LLM(target, device="cpu", page_size=4).generate(prompts, GREEDY)
    ]
    settings = SpecSettings(
        "EAGLE3",
        draft_model_path=spec_drafts["EAGLE3"],
        num_steps=3,
        eagle_topk=3,
        num_draft_tokens=8,
    )
    llm = LLM(target, page_size=4, speculative=settings, attention_backend="triton", **ENGINE)
    assert isinstance(llm.engine.attention_backend, TritonBackend)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.spec_verify_ct > 0 for o in outputs)


def test_auto_is_torch_on_cpu_and_triton_needs_cuda_or_the_interpreter(monkeypatch):
    cpu = torch.device("cpu")
    assert isinstance(make_attention_backend("auto", cpu), TorchReferenceBackend)
    assert isinstance(make_attention_backend("torch", cpu), TorchReferenceBackend)
    monkeypatch.setattr("pdserve.engine.kernels.INTERPRETING", False)
    with pytest.raises(AttentionBackendUnavailableError, match="TRITON_INTERPRET=1"):
        make_attention_backend("triton", cpu)
    with pytest.raises(AttentionBackendUnavailableError, match="one of"):
        make_attention_backend("flash", cpu)


def test_the_cli_flag_reaches_the_engine_config():
    import argparse

    from pdserve.commands.common import add_engine_flags, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--attention-backend", "torch", "--model-path", "m"])
    assert engine_config_from_args(args, "m").attention_backend == "torch"
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "flash"])
