"""Fused RMSNorm, optionally with the residual add before it, one row per program.

The numerics are transformers' RMSNorm, step by step: `s = x + residual` rounded to the dtype;
`s * rsqrt(mean(s^2) + eps)` in float32, rounded to the dtype; times the weight (in float32,
exact for a product of two half-precision values) rounded once more. So a model built with
these kernels computes what the torch layers compute, up to the float32 summation order of the
mean.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels.rounding import round_to


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    residual_row = residual_ptr + row * residual_row_stride + cols
    out = add_and_norm(x, residual_row, weight_ptr, cols, mask, hidden, eps, dtype, HAS_RESIDUAL)
    tl.store(out_ptr + row * out_row_stride + cols, out.to(dtype), mask=mask)


@triton.jit
def add_and_norm(
    x,
    residual_row,
    weight_ptr,
    cols,
    mask,
    hidden,
    eps,
    dtype: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """The RMSNorm of a float32 row `x` (with `HAS_RESIDUAL`, of `x` + the row at
    `residual_row`, which is updated to that sum), rounded step by step as the module
    docstring says; float32 values of `dtype`."""
    if HAS_RESIDUAL:
        residual = tl.load(residual_row, mask=mask, other=0.0).to(tl.float32)
        x = round_to(x + residual, dtype)
        tl.store(residual_row, x.to(dtype), mask=mask)
    mean_square = tl.sum(x * x, axis=0) / hidden
    normed = round_to(x * tl.rsqrt(mean_square + eps), dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return round_to(normed * weight, dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row of `x` `[T, hidden]`; with `residual` (same shape and dtype),
    `(norm(x + residual), x + residual)`.

    NOTE: the sum is written into `residual` in place (saving an allocation and a pass over
    memory); the returned second tensor *is* `residual`. Callers must own it.
    """
    if x.dim() != 2 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm takes [T, {weight.shape[0]}] input, got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match the input "
                f"{tuple(x.shape)} {x.dtype}"
            )
        if residual.stride(-1) != 1:
            raise ValueError("residual must be contiguous in its last dimension (updated in place)")
    rows, hidden = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    block = triton.next_power_of_2(hidden)
    if rows:
        _rms_norm_kernel[(rows,)](
            x,
            x if residual is None else residual,
            weight,
            out,
            x.stride(0),
            0 if residual is None else residual.stride(0),
            out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=row_num_warps(block),
        )
    return out if residual is None else (out, residual)


def row_num_warps(block: int) -> int:
    """Enough warps that each thread holds a few elements of a row of `block` (the kernels
    that norm a row use the same, so that they sum its squares in the same order)."""
    return min(max(block // 512, 1), 16)
