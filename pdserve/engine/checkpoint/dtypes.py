"""Names of the floating-point types the engine runs in, and their torch dtypes."""

from __future__ import annotations

import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]
