"""Choices shared by the kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels import INTERPRETING


def dot_settings(dtype: torch.dtype) -> tuple[bool, str | None]:
    """(upcast, input_precision) for `tl.dot` over operands of `dtype`.

    float32 runs at full precision ("ieee"): the default, tf32, keeps 10 mantissa bits and
    would make float32 engines differ from their torch reference. Half types run on the
    matrix units as they are, except under the interpreter, whose half-type matrix products
    are wrong (seen with Triton 3.9): there they are upcast to float32 first.
    """
    if dtype == torch.float32:
        return False, "ieee"
    if INTERPRETING:
        return True, "ieee"
    return False, None


@triton.jit
def load_kv_block(
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    keys,
    key_ok,
    stride_k_slot,
    stride_v_slot,
    k_head_offset,
    v_head_offset,
    dims,
    dim_ok,
    PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """K and V `[len(keys), dims]` of one KV head at a sequence's cache indices `keys`, read in
    place through its page-table row; keys that are not `key_ok` read as 0."""
    pages = tl.load(table_row_ptr + keys // PAGE_SIZE, mask=key_ok)
    slots = pages.to(tl.int64) * PAGE_SIZE + keys % PAGE_SIZE
    mask = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(
        k_cache_ptr + slots[:, None] * stride_k_slot + k_head_offset + dims[None, :],
        mask=mask,
        other=0.0,
    )
    v = tl.load(
        v_cache_ptr + slots[:, None] * stride_v_slot + v_head_offset + dims[None, :],
        mask=mask,
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v
