"""What one forward pass computes (`ForwardBatch`), what it keeps besides the final hidden states
(`Capture`), and what comes back (`ForwardOutput`).

Every pass of the target goes through `ModelRunner.forward` with a `ForwardBatch`: plain steps
(prefill chunks and decode tokens mixed), the chunks after which a draft model catches up, and
speculative verification. A sequence's new tokens are given explicitly, so a verification
pass (the last committed token, then the proposed ones) is one more sequence; tree proposals
add explicit positions (a node's position is its depth) and a mask (a node sees the cached
prefix, its ancestors and itself: the mask covers the new tokens, the prefix is visible).
Bookkeeping only: the tensor work is the runner's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from pdserve.engine.core.request import Request
from pdserve.engine.runtime.host_ints import host_ints

CAPTURE_KINDS = ("none", "final", "layers")


def device_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints as an int64 tensor on `device`, without waiting for the GPU: a blocking copy
    (`torch.tensor(values, device=...)`, or indexing a GPU tensor with a list) first waits for
    every kernel queued before it, which stalls the host mid-step."""
    return host_ints(values).to(device, non_blocking=True)


@dataclass(frozen=True)
class Capture:
    """Target features a forward pass keeps for a draft model, one row per new token: none
    (`Capture.NONE`), the final hidden states (`Capture.final()`, EAGLE), or the outputs of
    some layers side by side (`Capture.layers(ids)`, EAGLE-3)."""

    kind: str = "none"
    layer_ids: tuple[int, ...] = ()

    NONE: ClassVar[Capture]

    def __post_init__(self) -> None:
        if self.kind not in CAPTURE_KINDS:
            raise ValueError(f"capture kind must be one of {CAPTURE_KINDS}, got {self.kind!r}")
        if (self.kind == "layers") != bool(self.layer_ids):
            raise ValueError("a layers capture names at least one layer; other kinds name none")

    @classmethod
    def final(cls) -> Capture:
        return cls("final")

    @classmethod
    def layers(cls, layer_ids: Iterable[int]) -> Capture:
        return cls("layers", tuple(int(i) for i in layer_ids))


Capture.NONE = Capture()


@dataclass
class ForwardBatch:
    """The sequences of one forward pass. Sequence i owns `pages[i]`, has `num_computed[i]`
    tokens of KV already and computes `token_ids[i]` now, into the next slots. Their positions
    are the slots' unless `positions[i]` says otherwise; they attend causally unless `masks[i]`
    ([new tokens, width] bool) says which of the last `width` slots each may see (every slot
    before those is visible).
    `requests[i]` is the request whose sequence it is (None in tests that build passes by
    hand); the device page table keeps a row per request."""

    pages: list[list[int]] = field(default_factory=list)
    num_computed: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    positions: list[list[int] | None] = field(default_factory=list)
    masks: dict[int, torch.Tensor] = field(default_factory=dict)
    requests: list[Request | None] = field(default_factory=list)
    num_tokens: int = 0
    has_explicit_positions: bool = False

    def __len__(self) -> int:
        return len(self.token_ids)

    def add(
        self,
        pages: list[int],
        num_computed: int,
        token_ids: list[int],
        positions: list[int] | None = None,
        mask: torch.Tensor | None = None,
        *,
        request: Request | None = None,
    ) -> None:
        count = len(token_ids)
        if count == 0:
            raise ValueError("a sequence in a forward pass computes at least one token")
        if positions is not None and len(positions) != count:
            raise ValueError(f"{len(positions)} positions for {count} tokens")
        if mask is not None:
            rows, width = mask.shape
            if rows != count or not count <= width <= num_computed + count:
                raise ValueError(
                    f"mask of shape {tuple(mask.shape)} for {count} new tokens after "
                    f"{num_computed} cached ones; expected ({count}, width) with "
                    f"{count} <= width <= {num_computed + count}"
                )
            self.masks[len(self)] = mask
        self.pages.append(pages)
        self.num_computed.append(num_computed)
        self.token_ids.append(token_ids)
        self.positions.append(positions)
        self.requests.append(request)
        self.num_tokens += count
        self.has_explicit_positions |= positions is not None

    @property
    def is_decode(self) -> bool:
        """Every sequence computes one token at its next position, causally: a plain decode
        step, the one shape a CUDA graph replays."""
        return (
            self.num_tokens == len(self) > 0 and not self.masks and not self.has_explicit_positions
        )

    @property
    def query_lens(self) -> list[int]:
        return [len(t) for t in self.token_ids]

    def split_tokens(self, at: int) -> tuple[ForwardBatch, ForwardBatch]:
        """The pass as two: its first `at` new tokens and the rest, in order. A sequence that
        straddles `at` is in both, its later tokens after its earlier ones (so the second
        part reads the KV the first writes). Plain passes only: causal, slot positions."""
        if self.masks or self.has_explicit_positions:
            raise ValueError("only a causal pass at slot positions splits by tokens")
        if not 0 < at < self.num_tokens:
            raise ValueError(f"split at token {at} of a pass of {self.num_tokens}")
        first, second = ForwardBatch(), ForwardBatch()
        seen = 0
        for pages, computed, tokens, request in zip(
            self.pages, self.num_computed, self.token_ids, self.requests, strict=True
        ):
            head = min(max(at - seen, 0), len(tokens))
            if head:
                first.add(pages, computed, tokens[:head], request=request)
            if head < len(tokens):
                second.add(pages, computed + head, tokens[head:], request=request)
            seen += len(tokens)
        return first, second

    def flat_token_ids(self) -> list[int]:
        return [token for tokens in self.token_ids for token in tokens]

    def explicit_positions(self) -> list[list[int]] | None:
        """Every sequence's positions when some are explicit (the rest are their slots), else
        None."""
        if not self.has_explicit_positions:
            return None
        return [
            p if p is not None else list(range(start, start + len(tokens)))
            for p, start, tokens in zip(
                self.positions, self.num_computed, self.token_ids, strict=True
            )
        ]


@dataclass
class ForwardOutput:
    """A pass's final hidden states `[T, hidden]`, one row per new token in batch order, and
    the features its `Capture` kept (None for `Capture.NONE`). Sequence i owns rows
    `rows(i)`."""

    batch: ForwardBatch
    query_starts: list[int]
    hidden: torch.Tensor
    features: torch.Tensor | None

    def rows(self, index: int) -> slice:
        start = self.query_starts[index]
        return slice(start, start + len(self.batch.token_ids[index]))

    def last_row(self, index: int) -> int:
        return self.query_starts[index] + len(self.batch.token_ids[index]) - 1
