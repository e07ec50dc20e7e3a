"""Triton kernels for the GPU hot path: paged attention, rotary + KV write, fused norms.

Each kernel has a plain-torch counterpart that the tests hold it to. All of them also run
under Triton's interpreter (`TRITON_INTERPRET=1`, CPU tensors, numpy installed), which is how
CI on a CPU machine tests them. The variable must be set before this package is imported:
`triton.jit` reads it when the kernels are defined.
"""

from __future__ import annotations

import os

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def triton_available(device_type: str) -> str | None:
    """None if Triton kernels can run on tensors of `device_type`, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install triton)"
    if device_type == "cuda" or INTERPRETING:
        return None
    return (
        f"Triton kernels run on CUDA, or on the CPU only under TRITON_INTERPRET=1; "
        f"this engine runs on {device_type!r}"
    )
