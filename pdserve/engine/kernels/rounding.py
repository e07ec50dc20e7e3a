"""Rounding float32 values to the activation dtype inside kernels, as torch rounds them.

torch computes half-precision elementwise ops in float32 and rounds each result to the dtype
(round to nearest, ties to even). Fused kernels that reproduce several such ops in a row must
round after each one to stay bit-identical with the unfused torch model.

NOTE: bfloat16 is rounded in integer arithmetic, not with `.to(tl.bfloat16)`: Triton's
interpreter truncates that cast (the GPU rounds to nearest even), so the interpreter-run tests
would see other numerics than the GPU. Both round identically this way, for finite values.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 `x` rounded to `dtype` (to nearest, ties to even), returned as float32."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        lowest_kept = (bits >> 16) & 1
        bits = (bits + 0x7FFF + lowest_kept) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
