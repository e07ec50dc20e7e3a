"""Overlap scheduling: the host prepares step N+1 while the GPU runs step N.

A plain step ends by copying its sampled tokens to the host, and the next step cannot be
scheduled before they arrive: the GPU idles while the host checks stops, builds outputs and
schedules. Overlapped, a step launches its forward pass and its sampling, starts the tokens'
copy, and only then lands the previous step (waits for its tokens, appends them, checks
stops, reports). The tokens a step has not landed yet are placeholders in `token_ids`: the
next step's inputs read them from the device (`resolve_placeholders`).

A request that stops is found one step late: it already ran in the next step, whose token
for it is dropped (never emitted). Its pages are freed meanwhile; the stale step writes into
them before any later step can, in stream order.
"""

from __future__ import annotations

import torch

from pdserve.engine.core.request import Request


def placeholder(index: int) -> int:
    """The token id standing for the in-flight step's `index`-th sampled token."""
    return -1 - index


def is_placeholder(token: int) -> bool:
    return token < 0


def resolve_placeholders(ids: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """`ids` with every placeholder replaced by the device token it stands for (the previous
    step's; a speculator's proposals use the same scheme)."""
    if previous.numel() == 0:
        return ids
    index = (-1 - ids).clamp(min=0, max=previous.shape[0] - 1)
    return torch.where(ids < 0, previous[index], ids)


class InFlightStep:
    """A launched step's sampled tokens: on the device for the next step's inputs, and on
    their way to the host for landing."""

    def __init__(self, requests: list[Request], tokens: torch.Tensor):
        self.requests = requests  # the requests that sampled, in the order of `tokens`
        self.tokens = tokens
        on_gpu = tokens.device.type == "cuda"
        self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=on_gpu)
        self._host.copy_(tokens, non_blocking=on_gpu)
        self._done = None
        if on_gpu:
            self._done = torch.cuda.Event()
            self._done.record()

    def token_ids(self) -> list[int]:
        """The sampled tokens, once the step has run (waits for it)."""
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()
