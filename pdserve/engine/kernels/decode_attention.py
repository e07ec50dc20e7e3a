"""Paged decode attention: one new token per sequence, K/V read in place through the page
table (no gather, no padding to the longest sequence).

Split-KV (flash-decoding): each sequence's context is cut into `num_splits` chunks, one program
per (sequence, KV head, chunk), so that a small batch with a long context still fills the GPU.
Each program writes a partial output and its log-sum-exp; a second kernel merges the chunks.
With one split the first kernel writes the output directly.

Grouped-query attention: one program serves all query heads that share a KV head, so each
K/V block is read once for the group; the group's query heads are the rows of one matrix
product (padded to 16 rows, the smallest tile the matrix units take).

Nothing here depends on the data on the host: lengths live in device tensors and the grid
depends only on the batch size and `num_splits`, so a CUDA graph can capture the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels.common import dot_settings, load_kv_block

MAX_SPLITS = 32


def num_splits_for(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per sequence so that the grid has about two programs per multiprocessor."""
    wanted = triton.cdiv(2 * num_sms, max(batch * num_kv_heads, 1))
    return max(1, min(MAX_SPLITS, wanted))


# NOTE: the split count is a runtime argument, not a constant: each distinct constant would
# compile the kernel anew, and a mixed step's decode batch (any size) would then compile at
# serve time, long after the CUDA graphs' warm-up. Only whether there are several splits is
# a constant. The page table's width (a step's longest sequence, eagerly) is not
# specialized on either.
@triton.jit(do_not_specialize=["num_splits", "stride_table"])
def _decode_chunk_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    page_table_ptr,
    table_rows_ptr,
    kv_lens_ptr,
    rows_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_table,
    stride_out_token,
    stride_out_head,
    scale,
    window,
    num_splits,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SLIDING: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens_ptr + seq)
    row = tl.load(rows_ptr + seq)
    table_row = tl.load(table_rows_ptr + seq)

    # The new token sits at cache index kv_len - 1; a sliding window hides keys at or before
    # kv_len - 1 - window.
    start = 0
    if SLIDING:
        start = tl.maximum(kv_len - window, 0)
    chunk = tl.cdiv(tl.cdiv(kv_len - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, kv_len)

    group = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group
    dims = tl.arange(0, DIM_PAD)
    head_ok = group < GROUP
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + row * stride_q_token + heads[:, None] * stride_q_head + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    for block in range(lo, hi, BLOCK_N):
        tokens = block + offsets
        valid = tokens < hi
        k, v = load_kv_block(
            k_cache_ptr,
            v_cache_ptr,
            page_table_ptr + table_row * stride_table,
            tokens,
            valid,
            stride_k_slot,
            stride_v_slot,
            kv_head * stride_k_head,
            kv_head * stride_v_head,
            dims,
            dim_ok,
            PAGE_SIZE,
            UPCAST,
        )
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        probs = tl.exp(scores - new_best[:, None])
        rescale = tl.exp(best - new_best)
        total = total * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        best = new_best

    # An empty chunk (past the end of a short context) leaves total = 0: its output is 0
    # and its log-sum-exp -inf, so the merge gives it no weight. A sequence with no KV at
    # all (a CUDA graph's padding row, kv_len 0) gets an output of 0.
    safe_total = tl.where(total > 0, total, 1.0)
    out = acc / safe_total[:, None]
    out_mask = head_ok[:, None] & dim_ok[None, :]
    if not SPLIT:
        tl.store(
            out_ptr + row * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # part_out: [D, heads, num_splits, HEAD_DIM] fp32; part_lse: [D, heads, num_splits]
        num_heads = tl.num_programs(1) * GROUP
        part_rows = (seq * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)
        lse = tl.where(total > 0, best + tl.log(safe_total), float("-inf"))
        tl.store(part_lse_ptr + part_rows, lse, mask=head_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_chunks_kernel(
    part_out_ptr,
    part_lse_ptr,
    rows_ptr,
    out_ptr,
    stride_out_token,
    stride_out_head,
    num_splits,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(rows_ptr + seq)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    split_ok = splits < num_splits
    part_rows = (seq * tl.num_programs(1) + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part_rows, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every chunk empty: weights of 0
    weights = tl.exp(lse - top)
    total = tl.sum(weights, 0)
    weights = weights / tl.where(total > 0, total, 1.0)
    parts = tl.load(
        part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(weights[:, None] * parts, 0)
    tl.store(
        out_ptr + row * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    table_rows: torch.Tensor,
    kv_lens: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    num_splits: int,
) -> None:
    """Attend q's `rows` (`[D]`, one per sequence) over their sequences' cached keys and
    write the results into the same rows of `out`.

    q, out: [T, heads, head_dim]; k_cache, v_cache: [num_pages, page_size, kv_heads,
    head_dim]; page_table: [R, max_pages], sequence i's pages in row `table_rows[i]` (`[D]`);
    kv_lens: [D], each sequence's KV length including the new token (already in the cache;
    0 for a padding row, whose output is 0).
    """
    num_seqs = rows.shape[0]
    if num_seqs == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    k_slots = k_cache.view(-1, kv_heads, head_dim)
    v_slots = v_cache.view(-1, kv_heads, head_dim)
    upcast, precision = dot_settings(q.dtype)
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    part_out = part_lse = out  # unused with one split
    if num_splits > 1:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
    _decode_chunk_kernel[(num_seqs, kv_heads, num_splits)](
        q,
        k_slots,
        v_slots,
        page_table,
        table_rows,
        kv_lens,
        rows,
        out,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_slots.stride(0),
        k_slots.stride(1),
        v_slots.stride(0),
        v_slots.stride(1),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        scale,
        sliding_window or 0,
        num_splits,
        PAGE_SIZE=page_size,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_N=64,
        SPLIT=num_splits > 1,
        SLIDING=sliding_window is not None,
        UPCAST=upcast,
        PRECISION=precision,
        num_warps=4,
        num_stages=3,
    )
    if num_splits > 1:
        _merge_chunks_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            rows,
            out,
            out.stride(0),
            out.stride(1),
            num_splits,
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            SPLITS_PAD=MAX_SPLITS,
        )
