"""Reusable flat byte buffers for staging KV.

Fresh memory is slow to fill the first time (page faults: ~0.5 GB/s on the CPU machine where
this was measured, against several GB/s into memory already touched), so receive and staging
buffers are kept and handed out again instead of allocated per request. Thread-safe.

On a GPU, a buffer given back may still be read by work queued on the giver's stream (a
commit's scatter); `give` records an event there, and `take` makes the stream that will
write the buffer next wait for it. A new buffer is allocated on the stream that writes it
first: the caching allocator hands a block freed by work still queued on a stream (a forward
pass's temporaries) only to that same stream, so a transfer writing on its own stream never
lands in memory a pass is still using.
"""

from __future__ import annotations

import threading

import torch


class BufferPool:
    def __init__(self, device: torch.device, max_cached_bytes: int = 4 << 30):
        self.device = device
        self.max_cached_bytes = max_cached_bytes
        self._free: list[torch.Tensor] = []
        self._last_use: dict[int, torch.cuda.Event] = {}  # by id of a free CUDA buffer
        self._lock = threading.Lock()

    def take(self, nbytes: int, writer: torch.cuda.Stream | None = None) -> torch.Tensor:
        """A uint8 buffer of exactly `nbytes` (a view of a cached one when one is big enough).
        `writer`: the CUDA stream that writes it first (default: the current stream)."""
        with self._lock:
            fitting = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if not fitting:
                return self._new(nbytes, writer)
            # NOTE: by index, not list.remove: == on tensors compares elements.
            index = min(fitting, key=lambda i: self._free[i].numel())
            base = self._free.pop(index)
            last_use = self._last_use.pop(id(base), None)
        if last_use is not None:
            (writer or torch.cuda.current_stream(self.device)).wait_event(last_use)
        return base[:nbytes]

    def _new(self, nbytes: int, writer: torch.cuda.Stream | None) -> torch.Tensor:
        if self.device.type != "cuda" or writer is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        with torch.cuda.stream(writer):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer from `take`; the caller must not touch it afterwards (work it
        queued on its current stream may still read it)."""
        base = buffer if buffer._base is None else buffer._base
        last_use = None
        if base.device.type == "cuda":
            giver = torch.cuda.current_stream(base.device)
            last_use = torch.cuda.Event()
            last_use.record(giver)
            # NOTE: if the buffer is later dropped from the cache, its block is not handed out
            # again before the giver's work on it is done.
            base.record_stream(giver)
        with self._lock:
            self._free.append(base)
            if last_use is not None:
                self._last_use[id(base)] = last_use
            self._free.sort(key=torch.Tensor.numel, reverse=True)
            while sum(b.numel() for b in self._free) > self.max_cached_bytes:
                dropped = self._free.pop()  # the smallest first; large ones are costly to refill
                self._last_use.pop(id(dropped), None)

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)
