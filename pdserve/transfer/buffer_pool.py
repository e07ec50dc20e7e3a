"""Reusable flat byte buffers for staging KV.

Fresh memory is slow to fill the first time (page faults: ~0.5 GB/s on the CPU machine where
this was measured, against several GB/s into memory already touched), so receive and staging
buffers are kept and handed out again instead of allocated per request. Thread-safe.
"""

from __future__ import annotations

import threading

import torch


class BufferPool:
    def __init__(self, device: torch.device, max_cached_bytes: int = 4 << 30):
        self.device = device
        self.max_cached_bytes = max_cached_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of exactly `nbytes` (a view of a cached one when one is big enough)."""
        with self._lock:
            fitting = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fitting:
                # NOTE: by index, not list.remove: == on tensors compares elements.
                index = min(fitting, key=lambda i: self._free[i].numel())
                return self._free.pop(index)[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer from `take`; the caller must not touch it afterwards."""
        base = buffer if buffer._base is None else buffer._base
        with self._lock:
            self._free.append(base)
            self._free.sort(key=torch.Tensor.numel, reverse=True)
            while sum(b.numel() for b in self._free) > self.max_cached_bytes:
                self._free.pop()  # drop the smallest first; large ones are costly to refill

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)
