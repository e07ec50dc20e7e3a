"""Which attention backend an engine runs: chosen once, at start-up."""

from __future__ import annotations

import logging

import torch

from pdserve.engine.core.config import ATTENTION_BACKENDS
from pdserve.engine.kernels import triton_available
from pdserve.engine.runtime.attention.backend import AttentionBackend
from pdserve.engine.runtime.attention.torch_ref import TorchReferenceBackend

logger = logging.getLogger(__name__)


class AttentionBackendUnavailableError(ValueError):
    """The requested attention backend cannot run on this device or installation."""


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """'auto' is Triton on CUDA (torch if Triton is missing) and torch elsewhere; 'triton' on
    a CPU runs only under Triton's interpreter (TRITON_INTERPRET=1, for tests)."""
    if name not in ATTENTION_BACKENDS:
        raise AttentionBackendUnavailableError(
            f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}"
        )
    if name == "auto":
        if device.type != "cuda":
            return TorchReferenceBackend()
        reason = triton_available(device.type)
        if reason is not None:
            logger.warning("attention backend: torch reference, not Triton: %s", reason)
            return TorchReferenceBackend()
        name = "triton"
    if name == "torch":
        return TorchReferenceBackend()
    reason = triton_available(device.type)
    if reason is not None:
        raise AttentionBackendUnavailableError(
            f"--attention-backend triton cannot run: {reason}; use --attention-backend torch"
        )
    from pdserve.engine.runtime.attention.triton_backend import TritonBackend

    return TritonBackend(device)
