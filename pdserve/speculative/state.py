"""What a speculative algorithm keeps per request between steps, and what the decode side
hands its `build_disagg_draft_input` hook."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdserve.protocol.metadata_spec import MetadataSpec


@dataclass
class DraftState:
    """The first draft step's input: the draft's top-k after the last committed token
    (probabilities, target-vocabulary ids) and, for algorithms that carry one, the draft's
    hidden state there. All None for algorithms that need nothing (NGRAM)."""

    topk_p: torch.Tensor | None = None  # [topk] float32
    topk_index: torch.Tensor | None = None  # [topk] int64
    hidden: torch.Tensor | None = None  # [spec hidden size]


@dataclass(frozen=True)
class DraftBatch:
    """The requests whose KV just arrived on the decode worker, in record order, with what
    the handshake agreed (widths and topk the records must match)."""

    request_ids: list[str]
    spec: MetadataSpec
    device: torch.device


@dataclass
class ExtendItem:
    """Target tokens computed this step for one request, for the draft to catch up on:
    positions start .. start + len(next_tokens) - 1, the token that follows each of them, and
    the target features of those positions (None when the algorithm reads none)."""

    request: Any
    start: int
    next_tokens: list[int]
    features: torch.Tensor | None = None
