"""Paged extend attention: every multi-token sequence of a step in one launch (ragged).

A sequence with `q` new tokens and `kv` tokens of KV after this step (the new ones already
written to the cache) attends its new tokens over the cached prefix and, causally, over
each other: new token r sits at cache index `kv - q + r` and sees keys at indices up to its
own. A sliding window also hides keys at or before `index - window`. A sequence with an
explicit mask (speculative trees) sees every key before the last `w` and, of those last `w`
(its new tokens, and for a draft tree step the ancestors drafted before), the ones its
`[q, w]` mask allows.

One program per (sequence, query head, block of new tokens); K/V blocks are read through the
page table (flash attention with an online softmax, float32 accumulation), whose row for a
sequence is `table_rows[seq]`. Programs past a sequence's last new token do nothing; the
grid's third size is the longest run of new tokens the launch allows, which is host data: a
CUDA graph fixes it (speculative verification, a fixed number of tokens per sequence), a
prefill step does not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from pdserve.engine.kernels.common import dot_settings, load_kv_block

LOG2_E = 1.4426950408889634


@triton.jit
def _attend_keys(
    acc,
    best,
    total,
    q,
    start,
    end,
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    stride_k_slot,
    stride_v_slot,
    kv_head_k,
    kv_head_v,
    dims,
    dim_ok,
    rows,
    query_index,
    query_len,
    kv_len,
    scale_log2,
    window,
    mask_ptr,
    mask_offset,
    mask_width,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    SLIDING: tl.constexpr,
    HAS_MASKS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Online softmax of the rows over keys [start, end), one BLOCK_N block at a time.
    Unless MASKED, every key in the range is visible to every row (no causal, window or
    explicit mask is computed). Scores are kept in base 2: exp2 is the native instruction."""
    offsets = tl.arange(0, BLOCK_N)
    for block in range(start, end, BLOCK_N):
        keys = block + offsets
        key_ok = keys < end
        k, v = load_kv_block(
            k_cache_ptr,
            v_cache_ptr,
            table_row_ptr,
            keys,
            key_ok,
            stride_k_slot,
            stride_v_slot,
            kv_head_k,
            kv_head_v,
            dims,
            dim_ok,
            PAGE_SIZE,
            UPCAST,
        )
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if MASKED:
            allowed = key_ok[None, :] & (keys[None, :] <= query_index[:, None])
            if SLIDING:
                allowed &= keys[None, :] > query_index[:, None] - window
            if HAS_MASKS:
                # NOTE: a causal sequence's mask rows count as none (a scalar condition in a
                # load mask is refused by the interpreter).
                mask_rows = tl.where(mask_offset >= 0, query_len, 0)
                tail = kv_len - mask_width  # the first key the mask covers
                in_tail = key_ok & (keys >= tail)
                explicit = tl.load(
                    mask_ptr + mask_offset + rows[:, None] * mask_width + (keys - tail)[None, :],
                    mask=(rows[:, None] < mask_rows) & in_tail[None, :],
                    other=0,
                )
                seen = (explicit != 0) | (key_ok & (keys < tail))[None, :]
                allowed = tl.where(mask_offset >= 0, seen, allowed)
            scores = tl.where(allowed, scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        # NOTE: a row that has seen no key yet (all -inf so far) keeps a finite reference so
        # that exp2() gives 0 rather than NaN.
        reference = tl.where(new_best == float("-inf"), 0.0, new_best)
        probs = tl.exp2(scores - reference[:, None])
        rescale = tl.exp2(best - reference)
        total = total * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        best = new_best
    return acc, best, total


# NOTE: the page table's width (a step's longest sequence) is not specialized on: a new
# value would compile the kernel anew at serve time.
@triton.jit(do_not_specialize=["stride_table"])
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    page_table_ptr,
    table_rows_ptr,
    seq_index_ptr,
    query_starts_ptr,
    query_lens_ptr,
    kv_lens_ptr,
    mask_ptr,
    mask_offsets_ptr,
    mask_widths_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_table,
    stride_out_token,
    stride_out_head,
    scale_log2,
    window,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS_PER_SEQ: tl.constexpr,
    SLIDING: tl.constexpr,
    HAS_MASKS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.load(seq_index_ptr + tl.program_id(0))
    head = tl.program_id(1)
    # NOTE: the last blocks of rows see the most keys: they are launched first, so that the
    # short ones fill the tail.
    first_row = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_M
    query_len = tl.load(query_lens_ptr + seq)
    query_start = tl.load(query_starts_ptr + seq)
    kv_len = tl.load(kv_lens_ptr + seq)
    prefix = kv_len - query_len
    kv_head = head // GROUP

    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < query_len
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    tokens_of_rows = (query_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tokens_of_rows[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    query_index = prefix + rows  # each new token's own cache index

    # Keys this block of rows may see: causal up to the last row's index, and for a sliding
    # window from the first row's window start; a masked sequence may see any key.
    # A program past the sequence's last new token has no rows and runs no block.
    lo = 0
    hi = tl.minimum(kv_len, prefix + first_row + BLOCK_M)
    # Keys before this one are visible to every row: causally, those up to the first row's
    # index; with a mask, those before the keys it covers.
    seen_by_all = prefix + first_row + 1
    mask_offset = -1
    mask_width = 0
    if HAS_MASKS:
        mask_offset = tl.load(mask_offsets_ptr + seq)
        mask_width = tl.load(mask_widths_ptr + seq)
        hi = tl.where(mask_offset >= 0, kv_len, hi)
        seen_by_all = tl.where(mask_offset >= 0, kv_len - mask_width, seen_by_all)
    if SLIDING:
        lo = tl.maximum(prefix + first_row - window + 1, 0) // BLOCK_N * BLOCK_N
    hi = tl.where(first_row < query_len, hi, lo)
    # Without windows, whole blocks of keys seen by every row skip the mask.
    unmasked_end = lo
    if not SLIDING:
        unmasked_end = tl.minimum(seen_by_all // BLOCK_N * BLOCK_N, hi)

    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    table_row_ptr = page_table_ptr + tl.load(table_rows_ptr + seq) * stride_table
    for masked in tl.static_range(2):
        acc, best, total = _attend_keys(
            acc,
            best,
            total,
            q,
            unmasked_end if masked else lo,
            hi if masked else unmasked_end,
            k_cache_ptr,
            v_cache_ptr,
            table_row_ptr,
            stride_k_slot,
            stride_v_slot,
            kv_head * stride_k_head,
            kv_head * stride_v_head,
            dims,
            dim_ok,
            rows,
            query_index,
            query_len,
            kv_len,
            scale_log2,
            window,
            mask_ptr,
            mask_offset,
            mask_width,
            PAGE_SIZE=PAGE_SIZE,
            BLOCK_N=BLOCK_N,
            MASKED=masked == 1,
            SLIDING=SLIDING,
            HAS_MASKS=HAS_MASKS,
            UPCAST=UPCAST,
            PRECISION=PRECISION,
        )

    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    out_rows = out_ptr + tokens_of_rows[:, None] * stride_out_token + head * stride_out_head
    # NOTE: padded sequences (ROWS_PER_SEQ rows each) also write their padding rows, so that
    # no row of the output is left uninitialized; those rows are finite and ignored.
    stored = rows < ROWS_PER_SEQ if ROWS_PER_SEQ > 0 else row_ok
    tl.store(
        out_rows + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=stored[:, None] & dim_ok[None, :],
    )


def _block_sizes(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), the fastest measured on an H100
    (benchmarks/attention.py, RESULTS.md)."""
    if dtype == torch.float32:
        return 32, 32, 4, 2
    if head_dim <= 64:
        return 64, 64, 4, 3
    return 128, 128, 8, 3


# Blocks that fit any GPU Triton supports, for one whose shared memory is too small for the
# measured choice (it then raises OutOfResources once, at the first launch of a shape).
_SMALL_BLOCKS = (32, 32, 4, 2)
_too_large: set[tuple[int, int, int, int]] = set()


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    page_table: torch.Tensor,
    table_rows: torch.Tensor,
    seq_index: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    max_query_len: int,
    *,
    scale: float,
    sliding_window: int | None,
    mask_data: torch.Tensor | None = None,
    mask_offsets: torch.Tensor | None = None,
    mask_widths: torch.Tensor | None = None,
    rows_per_seq: int = 0,
) -> None:
    """Attend the new tokens of sequences `seq_index` (`[P]` indices into the per-sequence
    tensors `table_rows` (rows of `page_table [rows, max_pages]`), `query_starts`,
    `query_lens`, `kv_lens [B]`) and write the results into their rows of `out`.
    `max_query_len` bounds every sequence's `query_lens`.

    q, out: [T, heads, head_dim]; k_cache, v_cache: [num_pages, page_size, kv_heads,
    head_dim]. mask_data: flat bool masks, sequence i's `[query_len, mask_widths[i]]` mask
    (over its last `mask_widths[i]` keys; the keys before are visible) starting at
    `mask_offsets[i]` (-1: causal). rows_per_seq: sequence i owns rows
    `query_starts[i]` + [0, rows_per_seq) of q and out, its new tokens first and padding
    after (which gets finite values); 0: rows are packed, only new tokens' rows are written.
    """
    num_seqs = seq_index.shape[0]
    if num_seqs == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    k_slots = k_cache.view(-1, kv_heads, head_dim)
    v_slots = v_cache.view(-1, kv_heads, head_dim)
    upcast, precision = dot_settings(q.dtype)
    has_masks = mask_data is not None

    def launch(blocks: tuple[int, int, int, int]) -> None:
        block_m, block_n, warps, stages = blocks
        grid = (num_seqs, num_heads, triton.cdiv(max(max_query_len, rows_per_seq), block_m))
        _extend_kernel[grid](
            q,
            k_slots,
            v_slots,
            out,
            page_table,
            table_rows,
            seq_index,
            query_starts,
            query_lens,
            kv_lens,
            mask_data if has_masks else q,
            mask_offsets if has_masks else seq_index,
            mask_widths if has_masks else seq_index,
            q.stride(0),
            q.stride(1),
            k_slots.stride(0),
            k_slots.stride(1),
            v_slots.stride(0),
            v_slots.stride(1),
            page_table.stride(0),
            out.stride(0),
            out.stride(1),
            scale * LOG2_E,
            sliding_window or 0,
            PAGE_SIZE=page_size,
            GROUP=num_heads // kv_heads,
            HEAD_DIM=head_dim,
            DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            ROWS_PER_SEQ=rows_per_seq,
            SLIDING=sliding_window is not None,
            HAS_MASKS=has_masks,
            UPCAST=upcast,
            PRECISION=precision,
            num_warps=warps,
            num_stages=stages,
        )

    blocks = _block_sizes(head_dim, q.dtype)
    if blocks in _too_large:
        blocks = _SMALL_BLOCKS
    try:
        launch(blocks)
    except OutOfResources:
        if blocks == _SMALL_BLOCKS:
            raise
        _too_large.add(blocks)
        launch(_SMALL_BLOCKS)
