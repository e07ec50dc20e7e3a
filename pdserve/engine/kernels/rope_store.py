"""Rotary embedding and KV write in one kernel.

For each new token: rotate its query heads in place, rotate its key heads and write them,
with its value heads, into the token's cache slot. The torch path does the same in about a
dozen launches per layer (table lookups, casts, the half rotation, two index copies).

Numerics follow transformers' rotary: the float32 cos/sin tables are first cast to the
activation dtype; the rotation itself is computed in float32 and rounded once (torch rounds
after each multiply and the add: bf16 results may differ from it by an ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(base, stride_head, heads, cos, sin, dims, dims_ok, HALF: tl.constexpr):
    """Rotated (first half, second half) of the `heads` rows at `base` (float32)."""
    mask = (heads[:, None] >= 0) & dims_ok[None, :]
    at = base + heads[:, None] * stride_head + dims[None, :]
    first = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(at + HALF, mask=mask, other=0.0).to(tl.float32)
    return first * cos - second * sin, second * cos + first * sin


@triton.jit
def _rope_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    slots_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_table,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    slot = tl.load(slots_ptr + token)
    dims = tl.arange(0, HALF_PAD)
    dims_ok = dims < HALF
    # The tables hold [cos, cos] per position: the first half is enough.
    cos = tl.load(cos_ptr + position * stride_table + dims, mask=dims_ok, other=0.0)
    sin = tl.load(sin_ptr + position * stride_table + dims, mask=dims_ok, other=0.0)
    cos = cos.to(q_ptr.dtype.element_ty).to(tl.float32)[None, :]
    sin = sin.to(q_ptr.dtype.element_ty).to(tl.float32)[None, :]

    heads = tl.arange(0, HEADS_PAD)
    heads = tl.where(heads < NUM_HEADS, heads, -1)
    q_at = q_ptr + token * stride_q_token
    first, second = _rotate_heads(q_at, stride_q_head, heads, cos, sin, dims, dims_ok, HALF)
    q_rows = q_at + heads[:, None] * stride_q_head + dims[None, :]
    q_mask = (heads[:, None] >= 0) & dims_ok[None, :]
    tl.store(q_rows, first.to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_rows + HALF, second.to(q_ptr.dtype.element_ty), mask=q_mask)

    kv_heads = tl.arange(0, KV_HEADS_PAD)
    # NOTE: a negative slot (a CUDA graph's padding row) stores nothing: no head is valid.
    kv_heads = tl.where((kv_heads < NUM_KV_HEADS) & (slot >= 0), kv_heads, -1)
    kv_mask = (kv_heads[:, None] >= 0) & dims_ok[None, :]
    first, second = _rotate_heads(
        k_ptr + token * stride_k_token, stride_k_head, kv_heads, cos, sin, dims, dims_ok, HALF
    )
    cache_dtype = k_cache_ptr.dtype.element_ty
    k_rows = k_cache_ptr + slot * stride_kc_slot + kv_heads[:, None] * stride_kc_head
    k_rows += dims[None, :]
    tl.store(k_rows, first.to(cache_dtype), mask=kv_mask)
    tl.store(k_rows + HALF, second.to(cache_dtype), mask=kv_mask)

    v_at = v_ptr + token * stride_v_token + kv_heads[:, None] * stride_v_head + dims[None, :]
    v_rows = v_cache_ptr + slot * stride_vc_slot + kv_heads[:, None] * stride_vc_head
    v_rows += dims[None, :]
    tl.store(v_rows, tl.load(v_at, mask=kv_mask).to(cache_dtype), mask=kv_mask)
    tl.store(v_rows + HALF, tl.load(v_at + HALF, mask=kv_mask).to(cache_dtype), mask=kv_mask)


def rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Rotate q `[T, heads, head_dim]` in place; write rotated k and v (`[T, kv_heads,
    head_dim]`) at flat cache `slots` of k_cache/v_cache (`[num_pages, page_size, kv_heads,
    head_dim]`); a negative slot stores nothing. cos, sin: `[max_positions, head_dim]`
    float32 tables. Rows of q, k and v may be strided (views into one fused projection);
    the last dim must be contiguous."""
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    kv_heads = k.shape[1]
    k_slots = k_cache.view(-1, kv_heads, head_dim)
    v_slots = v_cache.view(-1, kv_heads, head_dim)
    half = head_dim // 2
    _rope_store_kernel[(num_tokens,)](
        q,
        k,
        v,
        positions,
        slots,
        cos,
        sin,
        k_slots,
        v_slots,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        k_slots.stride(0),
        k_slots.stride(1),
        v_slots.stride(0),
        v_slots.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(kv_heads),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=4,
    )
