"""Triton attention kernels at full size on the GPU, against the float64 reference: long
contexts over many splits, large page tables, 8B-shaped heads, bf16 and float32."""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine.kernels.test_attention_kernels import run_decode, run_extend
from tests.unit.kernel_cases import tolerance

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kv_heads, group, head_dim", [(8, 4, 64), (8, 4, 128), (4, 7, 128), (2, 8, 64)]
)
@pytest.mark.parametrize("splits", [1, 8, 32])
def test_decode_long_contexts(dtype, kv_heads, group, head_dim, splits):
    # Ragged: one token, page boundaries, and contexts far longer than one split.
    kv_lens = [1, 16, 4096, 4097, 777, 12000]
    error = run_decode(
        kv_lens,
        kv_heads=kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        splits=splits,
        seed=splits + head_dim,
    )
    assert error < tolerance(dtype)


@pytest.mark.parametrize("page_size", [1, 64])
def test_decode_sliding_window_and_page_sizes(page_size):
    error = run_decode(
        [3000, 70, 4096],
        page_size=page_size,
        kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        window=1024,
        splits=8,
        seed=page_size,
    )
    assert error < tolerance(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_extend_long_prompts_with_prefixes(dtype, head_dim):
    error = run_extend(
        [2048, 300, 1, 513],
        [2048, 4000, 900, 513],
        kv_heads=8,
        head_dim=head_dim,
        dtype=dtype,
        seed=head_dim,
    )
    assert error < tolerance(dtype)


def test_extend_window_and_tree_masks():
    error = run_extend(
        [1500, 9],
        [3000, 2000],
        kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        window=512,
        seed=1,
    )
    assert error < tolerance(torch.bfloat16)
    error = run_extend(
        [9, 700, 17],
        [2000, 1000, 3017],
        kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        masked=[0, 2],
        seed=2,
    )
    assert error < tolerance(torch.bfloat16)
