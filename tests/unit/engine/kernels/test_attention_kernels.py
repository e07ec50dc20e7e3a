"""Triton attention kernels against a float64 reference, on small random cases.

Without a GPU these run under Triton's interpreter (tests/conftest.py turns it on); the
same cases at full size run on the GPU in tests/gpu/test_attention_kernels_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.kernel_cases import paged_case, reference_attention, relative_error, tolerance

pytest.importorskip("triton")

from pdserve.engine.kernels.decode_attention import (
    MAX_SPLITS,
    num_splits_for,
    paged_decode_attention,
)
from pdserve.engine.kernels.extend_attention import paged_extend_attention
from pdserve.engine.kernels.rope_store import rope_and_store
from pdserve.engine.runtime.models.layers import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small float32 caches of 4-token pages, 2 KV heads of 32 dims.
SMALL_PAGES = {
    "page_size": 4,
    "kv_heads": 2,
    "head_dim": 32,
    "dtype": torch.float32,
    "device": DEVICE,
}


def run_decode(
    kv_lens,
    *,
    seed,
    page_size=16,
    kv_heads=2,
    group=4,
    head_dim=32,
    dtype=torch.float32,
    window=None,
    splits=1,
):
    generator = torch.Generator().manual_seed(seed)
    case = paged_case(
        kv_lens,
        page_size=page_size,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=DEVICE,
        generator=generator,
    )
    num_heads = kv_heads * group
    # Decode rows sit among other rows of the flattened batch, in a shuffled order.
    num_rows = len(kv_lens) + 2
    q = torch.randn(num_rows, num_heads, head_dim, generator=generator).to(dtype).to(DEVICE)
    rows = torch.randperm(num_rows, generator=generator)[: len(kv_lens)].to(DEVICE)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    # The sequences' pages sit in shuffled rows of a larger table (a persistent page table).
    table_rows = torch.randperm(len(kv_lens) + 3, generator=generator)[: len(kv_lens)]
    table = torch.zeros(len(kv_lens) + 3, case.page_table.shape[1], dtype=torch.int64)
    table[table_rows] = case.page_table.cpu()
    paged_decode_attention(
        q,
        case.k_cache,
        case.v_cache,
        table.to(DEVICE),
        table_rows.to(DEVICE),
        torch.tensor(kv_lens, device=DEVICE),
        rows,
        out,
        scale=scale,
        sliding_window=window,
        num_splits=splits,
    )
    want = torch.cat(
        [
            reference_attention(q[row : row + 1], case, i, scale=scale, sliding_window=window)
            for i, row in enumerate(rows.tolist())
        ]
    )
    got = out[rows]
    assert not got.isnan().any(), "an output element was never written"
    others = torch.ones(num_rows, dtype=torch.bool, device=DEVICE)
    others[rows] = False
    assert out[others].isnan().all(), "the kernel wrote rows that are not decode rows"
    return relative_error(got, want)


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_padding_rows_give_zeros(splits):
    """A CUDA graph's padding rows (kv_len 0) must not read the cache or produce NaN."""
    generator = torch.Generator().manual_seed(splits)
    case = paged_case([5, 9], generator=generator, **SMALL_PAGES)
    q = torch.randn(4, 4, 32, generator=generator).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(
        q,
        case.k_cache,
        case.v_cache,
        case.page_table,
        torch.tensor([0, 1, 0, 0], device=DEVICE),
        torch.tensor([5, 9, 0, 0], device=DEVICE),
        torch.arange(4, device=DEVICE),
        out,
        scale=32**-0.5,
        sliding_window=None,
        num_splits=splits,
    )
    assert not out[:2].isnan().any()
    assert (out[2:] == 0).all(), "a padding row's output is not 0"


@pytest.mark.parametrize(
    "page_size, kv_lens",
    [
        (1, [1, 2, 7]),
        (16, [1, 16, 17, 32, 45]),  # 16 and 32 end exactly on a page boundary
        (64, [64, 1, 130]),
    ],
)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_matches_reference(page_size, kv_lens, group):
    error = run_decode(
        kv_lens,
        page_size=page_size,
        group=group,
        seed=page_size * 10 + group,
    )
    assert error < tolerance(torch.float32)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_odd_head_counts(splits):
    """SmolLM2-135M's shape: 9 query heads over 3 KV heads (an odd group) of 64 dims."""
    error = run_decode(
        [1, 17, 40],
        page_size=16,
        kv_heads=3,
        group=3,
        head_dim=64,
        splits=splits,
        seed=splits + 300,
    )
    assert error < tolerance(torch.float32)


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_decode_split_kv_merges_chunks(splits):
    # 150 tokens span several 64-token blocks; 7 splits leave some chunks empty for the
    # shorter sequences (the merge must give those no weight).
    error = run_decode(
        [150, 5, 64],
        head_dim=64,
        splits=splits,
        seed=splits,
    )
    assert error < tolerance(torch.float32)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_sliding_window(splits):
    error = run_decode(
        [100, 9, 40],
        group=2,
        window=17,
        splits=splits,
        seed=splits + 100,
    )
    assert error < tolerance(torch.float32)


@pytest.mark.parametrize("head_dim", [48, 128])
def test_decode_head_dims_and_bf16(head_dim):
    error = run_decode(
        [33, 80],
        kv_heads=1,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        splits=2,
        seed=head_dim,
    )
    assert error < tolerance(torch.bfloat16)


def test_split_count_fills_the_gpu_and_is_bounded():
    assert num_splits_for(1, 8, 132) == MAX_SPLITS
    assert num_splits_for(16, 8, 132) == 3
    assert num_splits_for(256, 8, 132) == 1
    assert num_splits_for(0, 8, 132) == MAX_SPLITS


def run_extend(
    query_lens,
    kv_lens,
    *,
    seed,
    page_size=16,
    kv_heads=2,
    group=4,
    head_dim=32,
    dtype=torch.float32,
    window=None,
    masked=(),
):
    """Every sequence in one launch, with a shuffled subset of sequences as the extend ones."""
    generator = torch.Generator().manual_seed(seed)
    case = paged_case(
        kv_lens,
        page_size=page_size,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=DEVICE,
        generator=generator,
    )
    num_heads = kv_heads * group
    starts = [sum(query_lens[:i]) for i in range(len(query_lens))]
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(dtype)
    q = q.to(DEVICE)
    masks, full_masks = {}, {}
    for i in masked:
        # A tree-like mask over the last `width` keys (the keys before are visible): itself,
        # and a random subset of the others it covers.
        query_len, kv_len = query_lens[i], kv_lens[i]
        width = int(torch.randint(query_len, kv_len + 1, (1,), generator=generator))
        mask = torch.rand(query_len, width, generator=generator) < 0.5
        mask[torch.arange(query_len), width - query_len + torch.arange(query_len)] = True
        masks[i] = mask
        full_masks[i] = torch.ones(query_len, kv_len, dtype=torch.bool)
        full_masks[i][:, kv_len - width :] = mask
    offsets, widths, flat, start = [-1] * len(query_lens), [0] * len(query_lens), [], 0
    for i in sorted(masks):
        offsets[i], start = start, start + masks[i].numel()
        widths[i] = masks[i].shape[1]
        flat.append(masks[i].reshape(-1))
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    # The sequences' pages sit in shuffled rows of a larger table (a persistent page table).
    table_rows = torch.randperm(len(kv_lens) + 3, generator=generator)[: len(kv_lens)]
    table = torch.zeros(len(kv_lens) + 3, case.page_table.shape[1], dtype=torch.int64)
    table[table_rows] = case.page_table.cpu()
    paged_extend_attention(
        q,
        case.k_cache,
        case.v_cache,
        out,
        table.to(DEVICE),
        table_rows.to(DEVICE),
        torch.arange(len(query_lens)).flip(0).to(DEVICE),
        torch.tensor(starts, device=DEVICE),
        torch.tensor(query_lens, device=DEVICE),
        torch.tensor(kv_lens, device=DEVICE),
        max(query_lens),
        scale=scale,
        sliding_window=window,
        mask_data=torch.cat(flat).to(DEVICE) if flat else None,
        mask_offsets=torch.tensor(offsets, device=DEVICE) if flat else None,
        mask_widths=torch.tensor(widths, device=DEVICE) if flat else None,
    )
    assert not out.isnan().any(), "an output element was never written"
    want = torch.cat(
        [
            reference_attention(
                q[start : start + n],
                case,
                i,
                scale=scale,
                sliding_window=window,
                mask=full_masks.get(i),
            )
            for i, (start, n) in enumerate(zip(starts, query_lens, strict=True))
        ]
    )
    return relative_error(out, want)


@pytest.mark.parametrize(
    "page_size, query_lens, kv_lens",
    [
        (1, [3, 2, 7], [10, 2, 7]),
        (16, [16, 5, 40], [16, 37, 100]),  # 16: a whole page, no prefix
        (64, [70, 2], [200, 65]),  # 70 new tokens: more than one block of queries
    ],
)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_extend_matches_reference(page_size, query_lens, kv_lens, group):
    error = run_extend(
        query_lens,
        kv_lens,
        page_size=page_size,
        group=group,
        seed=page_size + group,
    )
    assert error < tolerance(torch.float32)


def test_extend_odd_head_counts():
    """SmolLM2-135M's shape (9 query heads over 3 KV heads of 64 dims): a whole prompt, a
    chunk after a prefix, a single token."""
    error = run_extend(
        [20, 7, 1],
        [20, 30, 9],
        kv_heads=3,
        group=3,
        head_dim=64,
        seed=9,
    )
    assert error < tolerance(torch.float32)


def test_extend_sliding_window():
    error = run_extend(
        [50, 9, 3],
        [80, 9, 60],
        group=2,
        window=13,
        seed=7,
    )
    assert error < tolerance(torch.float32)


def test_extend_tree_masks_beside_causal_sequences():
    # The last masked sequence has whole blocks of keys before its mask (they skip it).
    error = run_extend(
        [5, 40, 7, 6],
        [21, 40, 30, 150],
        masked=[0, 2, 3],
        seed=11,
    )
    assert error < tolerance(torch.float32)


def test_extend_bf16_head_dim_64():
    error = run_extend(
        [150, 33],
        [200, 33],
        head_dim=64,
        dtype=torch.bfloat16,
        seed=3,
    )
    assert error < tolerance(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, kv_heads, head_dim", [(4, 2, 16), (6, 3, 48), (9, 3, 64)])
def test_rope_store_matches_torch_rotary_and_store(dtype, num_heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    with torch.device(DEVICE):
        rotary = RotaryEmbedding(inv_freq, 1.0, 256)
    tokens, page_size, num_pages = 7, 4, 6
    # q, k, v are views of one fused projection, as in the model.
    qkv = torch.randn(tokens, (num_heads + 2 * kv_heads) * head_dim, generator=generator)
    qkv = qkv.to(dtype).to(DEVICE)
    q, k, v = qkv.split([num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = q.view(tokens, num_heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 256, (tokens,), generator=generator).to(DEVICE)
    slots = torch.randperm(num_pages * page_size, generator=generator)[:tokens].to(DEVICE)
    slots[-1] = -1  # a CUDA graph's padding row: rotated, never stored
    stored = slots[:-1]
    cache_shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    want_q, want_k = rotary(positions, q.clone(), k.clone())
    rope_and_store(q, k, v, positions, slots, rotary.cos, rotary.sin, k_cache, v_cache)
    got_k = k_cache.view(-1, kv_heads, head_dim)[stored]
    got_v = v_cache.view(-1, kv_heads, head_dim)[stored]
    want_k = want_k[:-1]
    # float32: equal up to fused multiply-adds (the GPU compiler contracts a*b + c); bf16: the
    # kernel rounds once where torch rounds three times.
    ulp = 1e-6 if dtype == torch.float32 else 2.0**-6
    for got, want in ((q, want_q), (got_k, want_k)):
        assert torch.allclose(got.double(), want.double(), rtol=ulp, atol=ulp)
    assert torch.equal(got_v, v[:-1])
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool, device=DEVICE)
    untouched[stored] = False
    assert k_cache.view(-1, kv_heads, head_dim)[untouched].isnan().all()


def test_extend_falls_back_to_small_blocks_where_shared_memory_is_short(monkeypatch):
    from triton.runtime.errors import OutOfResources

    from pdserve.engine.kernels import extend_attention

    real, tried = extend_attention._extend_kernel, []

    class SmallGpu:
        """The real kernel, except that blocks past 32 rows do not fit."""

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                tried.append(kwargs["BLOCK_M"])
                if kwargs["BLOCK_M"] > 32:
                    raise OutOfResources(300_000, 232_448, "shared memory")
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(extend_attention, "_extend_kernel", SmallGpu())
    monkeypatch.setattr(extend_attention, "_too_large", set())
    for _ in range(2):
        error = run_extend(
            [40, 3],
            [40, 20],
            group=2,
            head_dim=128,
            dtype=torch.bfloat16,
            seed=5,
        )
        assert error < tolerance(torch.bfloat16)
    # The measured choice is tried once; later launches go straight to the small blocks.
    assert tried == [128, 32, 32]


def test_extend_over_padded_rows_writes_every_row():
    """A verification graph's layout: each sequence owns `rows_per_seq` rows, its new tokens
    first; padding rows (and a padding sequence with no tokens) get finite values."""
    generator = torch.Generator().manual_seed(21)
    query_lens, kv_lens, rows_per_seq = [3, 5, 0], [9, 5, 0], 5
    case = paged_case([9, 5, 1], generator=generator, **SMALL_PAGES)
    q = torch.randn(3 * rows_per_seq, 8, 32, generator=generator).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # over its 3 tokens
    paged_extend_attention(
        q,
        case.k_cache,
        case.v_cache,
        out,
        case.page_table,
        torch.arange(3).to(DEVICE),
        torch.arange(3).to(DEVICE),
        torch.tensor([0, rows_per_seq, 2 * rows_per_seq], device=DEVICE),
        torch.tensor(query_lens, device=DEVICE),
        torch.tensor(kv_lens, device=DEVICE),
        rows_per_seq,
        scale=32**-0.5,
        sliding_window=None,
        mask_data=mask.reshape(-1).to(DEVICE),
        mask_offsets=torch.tensor([0, -1, -1], device=DEVICE),
        mask_widths=torch.tensor([3, 0, 0], device=DEVICE),
        rows_per_seq=rows_per_seq,
    )
    assert out.isfinite().all(), "a padding row was left unwritten"
    full = torch.ones(3, 9, dtype=torch.bool)
    full[:, 6:] = mask
    first = reference_attention(q[:3], case, 0, scale=32**-0.5, mask=full)
    second = reference_attention(q[5:10], case, 1, scale=32**-0.5)
    assert relative_error(out[:3], first) < tolerance(torch.float32)
    assert relative_error(out[5:10], second) < tolerance(torch.float32)
