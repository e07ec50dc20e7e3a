"""What the engine asks of speculative decoding: one `Speculator`, passed to `Engine` (None:
plain decoding). Speculation is composed, not inherited (docs/architecture/layout.md): the engine
knows this interface only, and `pdserve.speculative` implements it (`build_speculator`).

A step with a speculator: `propose` drafts for the requests ready to (fully computed, one
token scheduled); one forward pass computes the other requests' chunks and every draft's
verification (`Draft`: the last committed token, then the proposals); requests without a draft
sample as usual, requests with one keep what `verify` accepts; `catch_up` then keeps the
accepted KV and brings the draft up to date with every token the target computed.

Proposals drafted on the device may stay there until verification: their ids in `token_ids`
are placeholders (`pdserve.engine.runtime.overlap.placeholder`) for `Proposals.device_tokens`, which
the forward pass reads on the device. The host sees them first when `verify` copies them,
with the target's choices, in one copy for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from pdserve.engine.core.request import Request
from pdserve.engine.core.scheduler import ScheduledBatch
from pdserve.engine.runtime.forward_batch import Capture, ForwardOutput
from pdserve.engine.runtime.page_table import DevicePageTable
from pdserve.protocol.metadata_spec import MetadataSpec

if TYPE_CHECKING:
    from pdserve.engine.engine import Engine

# (token, its logprob or None, its top logprobs or None), as the engine appends a token.
Emitted = tuple[int, float | None, dict[int, float] | None]


@dataclass(kw_only=True)
class Draft:
    """One request's proposal as its verification pass computes it: `token_ids` are the last
    committed token and then the proposed ones (or placeholders for them, see
    `Proposals`). A chain needs nothing more (consecutive positions, causal); a tree gives
    each token's `positions` and a `mask` ([len(token_ids), len(token_ids)]: which new
    tokens each may see; all see the cache).
    """

    token_ids: list[int]
    positions: list[int] | None = None
    mask: torch.Tensor | None = None


@dataclass
class Proposals:
    """A step's drafts by index in the batch, and the device tokens their placeholder ids
    stand for (None: every id is on the host)."""

    drafts: dict[int, Draft]
    device_tokens: torch.Tensor | None = None


@dataclass(frozen=True)
class DraftHandoff:
    """What a prefill -> decode handoff moves for the draft: compared at registration,
    carried in each request's metadata record, and the draft's KV pools (sharing the
    target's page ids)."""

    algorithm: str
    topk: int
    num_steps: int
    num_draft_tokens: int
    metadata: MetadataSpec
    draft_pools: list = field(default_factory=list)
    draft_config: dict | None = None


class Speculator(Protocol):
    """The engine's side of speculative decoding. Start-up calls, in order: `load`,
    `draft_page_bytes`, `build_pools`, `lookahead_slots`, `target_capture`, `verify_tokens`,
    `build_graphs`; then each step
    `propose`, `verify` (the batch's drafts at once) and `catch_up`."""

    def load(self, engine: Engine) -> None:
        """Load draft models: after the target, before the KV pools are sized."""

    def draft_page_bytes(self) -> int:
        """Bytes per page of draft KV (0 without): pools sharing the target's page ids."""

    def build_pools(self, num_pages: int) -> None:
        """Allocate the draft's KV pools, `num_pages` pages sharing the target's page ids."""

    def build_graphs(self, page_table: DevicePageTable, max_tokens: int) -> None:
        """Capture the draft's CUDA graphs for batches of up to `max_tokens` tokens over the
        engine's page table; with `max_tokens` 0 (graphs off), none."""

    def lookahead_slots(self) -> int:
        """KV slots past a request's last committed token one step may write."""

    def kv_tokens_for_transfer(self, num_prompt_tokens: int) -> int:
        """Token slots of KV a prefill -> decode handoff moves for a prompt of this length."""

    def target_capture(self) -> Capture:
        """Target features the draft reads, kept by every forward pass."""

    def handoff(self, hidden_dtype: str) -> DraftHandoff:
        """What a disaggregated worker's handoff moves for the draft (`hidden_dtype`: the
        target's dtype, which the hidden states travel in)."""

    def seed_drafts(self, requests: list[Request], records: list) -> list:
        """Decode: the first draft state of each request whose KV landed, from the metadata
        records prefill sent (one each, never None); ValueError where it cannot."""

    def verify_tokens(self) -> int:
        """The most tokens a verification computes per request, the last committed one
        included (what a verification's CUDA graph is captured for)."""

    def propose(self, batch: ScheduledBatch) -> Proposals:
        """Drafts for the requests of `batch` ready to speculate, by index in the batch."""

    def verify(
        self, requests: list[Request], drafts: list[Draft], logits: torch.Tensor
    ) -> list[list[Emitted]]:
        """The tokens each request emits after its verification pass (`logits`: each draft's
        rows in turn, one per token of its `token_ids`): the accepted proposals, then one the
        target chose."""

    def catch_up(
        self, batch: ScheduledBatch, output: ForwardOutput, drafts: dict[int, Draft]
    ) -> None:
        """After the step's tokens were appended: keep the accepted proposals' KV, and catch
        the draft up on what `output`'s pass computed."""
