"""Speculative decoding settings (the `--speculative-*` flags, SGLang's names). Torch-free.

They live in `protocol/` because every side reads them: the engine's config carries them, the
speculative package builds its algorithm from them, and a handshake compares them between a
prefill and a decode worker. What they mean (drafting and verification) is
`pdserve.speculative`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.protocol.flags import option

MAX_TOPK = 16  # the most topk entries a metadata record (and a tree level) carries


class SpeculativeConfigError(ValueError):
    """Speculative settings that cannot work; the message names the setting."""


@dataclass(frozen=True)
class SpecSettings:
    """num_steps: draft steps (tree depth). eagle_topk: branches per step (1 = a chain).
    num_draft_tokens: tokens verified per step, the last committed one included (None: steps
    + 1 for a chain, min(steps x topk, what the tree holds) + 1 for a tree)."""

    algorithm: str = option(
        help="EAGLE, EAGLE3, STANDALONE, NGRAM or a registered plugin (default: off)",
        name="--speculative-algorithm",
    )
    draft_model_path: str | None = option(
        None,
        "the draft model (EAGLE/EAGLE3 head, or a small LLM for STANDALONE)",
        name="--speculative-draft-model-path",
    )
    num_steps: int = option(3, "draft steps", name="--speculative-num-steps")
    eagle_topk: int = option(
        1, "branches per draft step; 1 drafts a chain, more a tree", name="--speculative-eagle-topk"
    )
    num_draft_tokens: int | None = option(
        None,
        "tokens verified per step, the last committed one included (default: num-steps + 1 "
        "for a chain, min(num-steps x topk, tree size) + 1 for a tree)",
        name="--speculative-num-draft-tokens",
    )

    def __post_init__(self) -> None:
        if self.num_draft_tokens is None and self.num_steps >= 1 and self.eagle_topk >= 1:
            tokens = min(self.num_steps * self.eagle_topk, self.tree_capacity) + 1
            object.__setattr__(self, "num_draft_tokens", tokens)
        if not self.algorithm:
            raise SpeculativeConfigError("--speculative-algorithm must name an algorithm")
        if self.num_steps < 1:
            raise SpeculativeConfigError(
                f"--speculative-num-steps must be at least 1, got {self.num_steps}"
            )
        if not 1 <= self.eagle_topk <= MAX_TOPK:
            raise SpeculativeConfigError(
                f"--speculative-eagle-topk must be in [1, {MAX_TOPK}], got {self.eagle_topk}"
            )
        if self.num_draft_tokens is None or self.num_draft_tokens < 2:
            raise SpeculativeConfigError(
                f"--speculative-num-draft-tokens must be at least 2, got {self.num_draft_tokens}"
            )
        if self.eagle_topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise SpeculativeConfigError(
                "with --speculative-eagle-topk 1 (a chain) --speculative-num-draft-tokens must "
                f"be --speculative-num-steps + 1 = {self.num_steps + 1}, got "
                f"{self.num_draft_tokens}"
            )
        most = self.tree_capacity
        if self.num_draft_tokens - 1 > most:
            raise SpeculativeConfigError(
                f"--speculative-num-draft-tokens {self.num_draft_tokens} asks for more than the "
                f"{most} draft tokens that {self.num_steps} steps of topk {self.eagle_topk} "
                f"propose (at most {most + 1})"
            )

    @property
    def tree_capacity(self) -> int:
        """Draft tokens a tree of this shape proposes: topk at the first step, topk^2
        candidates at each later one."""
        return self.eagle_topk + (self.num_steps - 1) * self.eagle_topk**2

    @property
    def is_chain(self) -> bool:
        return self.eagle_topk == 1
