"""What a speculative algorithm is: its capabilities, its settings, the metadata it moves from
prefill to decode, and the hook that turns that metadata into its first draft input.

Buffers are sized from configs alone (the draft's `spec_hidden_size`, hc_mult aware), so a
rank that has not loaded the draft sizes them the same way. Two hidden widths exist and are
never confused: the draft's recurrent width (what crosses prefill -> decode, sized here) and
the target's capture width (extend phase; the algorithm's own business).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

from pdserve.transfer.metadata_spec import MAX_TOPK, MetadataSpec


class SpeculativeConfigError(ValueError):
    """Speculative settings that cannot work; the message names the setting."""


@dataclass(frozen=True)
class Capabilities:
    """has_draft_kv: the draft keeps its own KV cache (moved prefill -> decode with the target's).
    carries_hidden: a hidden-state row seeds the first draft step (EAGLE family).
    seeds_topk: the target's top-k (probabilities, ids) seeds the first draft step."""

    has_draft_kv: bool
    carries_hidden: bool
    seeds_topk: bool


@dataclass(frozen=True)
class SpecSettings:
    """The `--speculative-*` flags (SGLang's names)."""

    algorithm: str
    draft_model_path: str | None = None
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int = 4

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise SpeculativeConfigError(
                f"--speculative-num-steps must be at least 1, got {self.num_steps}"
            )
        if not 1 <= self.eagle_topk <= MAX_TOPK:
            raise SpeculativeConfigError(
                f"--speculative-eagle-topk must be in [1, {MAX_TOPK}], got {self.eagle_topk}"
            )
        if self.eagle_topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise SpeculativeConfigError(
                "with --speculative-eagle-topk 1 (a chain) --speculative-num-draft-tokens must "
                f"be --speculative-num-steps + 1 = {self.num_steps + 1}, got "
                f"{self.num_draft_tokens}"
            )
        if self.num_draft_tokens < 2:
            raise SpeculativeConfigError(
                f"--speculative-num-draft-tokens must be at least 2, got {self.num_draft_tokens}"
            )


class SpeculativeAlgorithm(abc.ABC):
    """Subclass, set `name` and `capabilities`, implement the hook, and register it
    (`pdserve.speculative.registry.register`, or the `pdserve.speculative` entry points)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def __init__(self, settings: SpecSettings):
        self.settings = settings

    def metadata_spec(
        self, draft_config: dict[str, Any] | None, hidden_dtype: str | None
    ) -> MetadataSpec:
        """What one request's metadata record holds, from configs alone."""
        caps = self.capabilities
        if caps.carries_hidden and draft_config is None:
            raise SpeculativeConfigError(
                f"{self.name} carries hidden states: it needs --speculative-draft-model-path"
            )
        return MetadataSpec.for_algorithm(
            seeds_topk=caps.seeds_topk,
            carries_hidden=caps.carries_hidden,
            topk=self.settings.eagle_topk,
            draft_config=draft_config,
            hidden_dtype=hidden_dtype if caps.carries_hidden else None,
        )

    @abc.abstractmethod
    def build_disagg_draft_input(self, batch: Any, last_tokens: Any, records: list) -> Any:
        """Turn the metadata records received from prefill into this algorithm's first draft
        input on the decode side. Required: raise a clear error where it cannot proceed (an
        empty batch it cannot handle, a missing hidden state, a width or topk that disagrees
        with the handshake); never return None."""
