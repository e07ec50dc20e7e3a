"""Choices shared by the kernels."""

from __future__ import annotations

import torch

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
