"""Sizes of the per-request metadata record that travels with the KV
(docs/architecture/metadata.md).

Computed from configs alone, so a rank that never loads the draft model can size its buffers.
The hidden-state row is the draft's recurrent width, `spec_hidden_size` of the *draft* config
(hc_mult aware), never the target's capture width. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.protocol.spec_settings import MAX_TOPK


def spec_hidden_size_of(hf_config: dict[str, Any]) -> int:
    """Width of the hidden-state row that speculative decoding carries
    (docs/architecture/metadata.md).

    `hidden_size * hc_mult` for models with hyper-connections (`hc_mult > 1`), else
    `hidden_size`. Computed from the config alone, so a rank without the model loaded can size
    its buffers.
    """
    hidden = int(hf_config["hidden_size"])
    hc_mult = int(hf_config.get("hc_mult") or 1)
    return hidden * hc_mult if hc_mult > 1 else hidden


class MetadataSpecError(ValueError):
    """Inconsistent speculative settings for the metadata record."""


@dataclass(frozen=True)
class MetadataSpec:
    """topk: entries of topk_p (float32) and topk_index (int64), 0 if none are seeded.
    hidden_size / hidden_dtype: the hidden_states row, None for algorithms that carry none."""

    topk: int = 0
    hidden_size: int | None = None
    hidden_dtype: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.topk <= MAX_TOPK:
            raise MetadataSpecError(f"topk must be in [0, {MAX_TOPK}], got {self.topk}")
        if (self.hidden_size is None) != (self.hidden_dtype is None):
            raise MetadataSpecError("hidden_size and hidden_dtype are set together or not at all")
        if self.hidden_size is not None and self.hidden_size < 1:
            raise MetadataSpecError(f"hidden_size must be positive, got {self.hidden_size}")

    @classmethod
    def for_algorithm(
        cls,
        *,
        seeds_topk: bool,
        carries_hidden: bool,
        topk: int,
        draft_config: dict[str, Any] | None,
        hidden_dtype: str | None,
    ) -> MetadataSpec:
        """Size the record from the algorithm's capabilities and the draft's HF config."""
        if not carries_hidden:
            return cls(topk=topk if seeds_topk else 0)
        if draft_config is None:
            raise MetadataSpecError("an algorithm that carries hidden state needs a draft config")
        if hidden_dtype is None:
            raise MetadataSpecError("an algorithm that carries hidden state needs hidden_dtype")
        return cls(
            topk=topk if seeds_topk else 0,
            hidden_size=spec_hidden_size_of(draft_config),
            hidden_dtype=hidden_dtype,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor part of one record (topk_p, topk_index, hidden_states)."""
        element = {"float32": 4, "bfloat16": 2, "float16": 2}
        hidden = 0 if self.hidden_size is None else self.hidden_size * element[self.hidden_dtype]
        return self.topk * (4 + 8) + hidden
