"""Fused SwiGLU activation: `silu(gate) * up` from the gate/up projection's output.

Numerics follow torch's unfused `F.silu(gate) * up` in the activation dtype: silu computed in
float32 as `x / (1 + exp(-x))` and rounded to the dtype, then the product computed in float32
and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels.rounding import round_to

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    gate_up_row_stride,
    out_row_stride,
    intermediate,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate_row = gate_up_ptr + row * gate_up_row_stride
    gate = tl.load(gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_row + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dtype)
    out = round_to(silu * up, dtype)
    tl.store(out_ptr + row * out_row_stride + cols, out.to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`[T, 2 * I]` (gate then up) -> `silu(gate) * up` `[T, I]`."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_and_mul takes [T, 2 * I] input, got {tuple(gate_up.shape)}")
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    block = min(_BLOCK, triton.next_power_of_2(intermediate))
    if rows and intermediate:
        grid = (rows, triton.cdiv(intermediate, block))
        _silu_and_mul_kernel[grid](
            gate_up, out, gate_up.stride(0), out.stride(0), intermediate, BLOCK=block
        )
    return out
