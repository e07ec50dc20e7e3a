"""Python ints as an int64 CPU tensor, the fast way."""

from __future__ import annotations

import array
from collections.abc import Iterable

import torch


def host_ints(values: Iterable[int]) -> torch.Tensor:
    """A 1-D int64 CPU tensor of `values`, through a typed buffer the tensor then shares:
    ~4x faster than `torch.tensor(list)`, which converts element by element (an 8k-token
    prompt's ids: ~290 against ~80 µs)."""
    buffer = array.array("q", values)
    if not buffer:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(buffer, dtype=torch.int64)
