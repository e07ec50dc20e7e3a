"""What a speculative algorithm is: its capabilities, its settings, how it drafts, the metadata
it moves from prefill to decode, and the hook that turns that metadata into its first draft
input.

Buffers are sized from configs alone (the draft's `spec_hidden_size`, hc_mult aware), so a
rank that has not loaded the draft sizes them the same way. Two hidden widths exist and are
never confused: the draft's recurrent width (what crosses prefill -> decode, sized here) and
the target's capture width (extend phase: `ExtendItem.features`, the algorithm's own business).

The engine's speculator (`speculator.py`) drives an algorithm through these calls: `load` (draft
models, before the KV pools are sized), `build_pools` (draft KV sharing the target's page ids),
`build_graphs` (CUDA graphs of its draft steps, optional),
`extend` (after the target computed tokens: catch the draft up, return each request's next
`DraftState`) and `propose` (a `DraftTree` per request). Algorithms without a draft model
(NGRAM, most plugins) implement only `propose` and the disaggregation hook.
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from pdserve.engine.checkpoint.model_files import resolve_model_dir
from pdserve.engine.runtime.forward_batch import Capture
from pdserve.protocol.metadata_spec import MetadataSpec
from pdserve.protocol.spec_settings import SpecSettings, SpeculativeConfigError
from pdserve.speculative.state import DraftBatch, DraftState, ExtendItem
from pdserve.speculative.tree import DraftTree

__all__ = [
    "Capabilities",
    "DraftInputError",
    "SpecSettings",
    "SpeculativeAlgorithm",
    "SpeculativeConfigError",
]


class DraftInputError(ValueError):
    """Metadata from prefill that cannot seed this algorithm's first draft step."""


@dataclass(frozen=True)
class Capabilities:
    """has_draft_kv: the draft keeps its own KV cache (moved prefill -> decode with the target's).
    carries_hidden: a hidden-state row seeds the first draft step (EAGLE family).
    seeds_topk: the draft's top-k (probabilities, ids) seeds the first draft step."""

    has_draft_kv: bool
    carries_hidden: bool
    seeds_topk: bool


class SpeculativeAlgorithm(abc.ABC):
    """Subclass, set `name` and `capabilities`, implement `propose` and
    `build_disagg_draft_input`, and register it (`pdserve.speculative.registry.register`, or
    the `pdserve.speculative` entry points)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def __init__(self, settings: SpecSettings):
        self.settings = settings
        self.check_settings()

    # ---- configuration, from configs alone ------------------------------------------

    def check_settings(self) -> None:
        caps = self.capabilities
        needs_draft = caps.has_draft_kv or caps.carries_hidden
        if needs_draft and not self.settings.draft_model_path:
            raise SpeculativeConfigError(
                f"{self.name} drafts with a model: it needs --speculative-draft-model-path"
            )
        if not needs_draft and self.settings.draft_model_path:
            raise SpeculativeConfigError(
                f"{self.name} has no draft model; drop --speculative-draft-model-path"
            )

    def draft_dir(self) -> Path:
        """The draft model's local directory: --speculative-draft-model-path names it as
        --model-path names the target (a directory, a GGUF file or a hub id)."""
        path = self.settings.draft_model_path
        try:
            return resolve_model_dir(path)
        except ValueError as e:
            raise SpeculativeConfigError(f"--speculative-draft-model-path: {e}") from None

    def draft_config(self) -> dict[str, Any] | None:
        """The draft's HF config, read from --speculative-draft-model-path (None if none)."""
        if not self.settings.draft_model_path:
            return None
        config_file = self.draft_dir() / "config.json"
        if not config_file.is_file():
            raise SpeculativeConfigError(
                f"--speculative-draft-model-path {self.settings.draft_model_path}: "
                "no config.json there"
            )
        return json.loads(config_file.read_text())

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

    def lookahead_slots(self) -> int:
        """KV slots past the last committed token one step may write: the verified tokens,
        and the draft's tree nodes (draft models)."""
        s = self.settings
        fed = (s.num_steps - 1) * s.eagle_topk
        return max(s.num_draft_tokens, fed + 1) + 1

    # ---- runtime: the engine's speculator calls these --------------------------------

    def target_capture(self) -> Capture:
        """Target features the draft reads (valid after `load`): `Capture.NONE`, the final
        hidden states (`Capture.final()`) or the outputs of some layers
        (`Capture.layers(ids)`)."""
        return Capture.NONE

    def load(self, engine) -> None:
        """Load draft models (before the KV pools are sized). Default: nothing."""
        self.engine = engine

    def draft_page_bytes(self) -> int:
        """Bytes per page of the draft's KV (0 without draft KV)."""
        return 0

    def build_pools(self, num_pages: int) -> None:
        """Allocate the draft's KV pools, `num_pages` pages sharing the target's page ids.
        Default: none."""
        return None

    def draft_pools(self) -> list:
        return []

    def build_graphs(self, page_table, max_tokens: int) -> None:
        """Capture the draft's CUDA graphs for batches of up to `max_tokens` tokens, over the
        engine's persistent `page_table` (0: none, graphs are off or there is no GPU; run
        the same static inputs eagerly on CPU where the engine does). Default: none."""
        return None

    def extend(self, items: list[ExtendItem]) -> list[DraftState]:
        """Catch the draft up on target tokens computed this step; the next draft input of
        each item's request (used once the request is fully computed)."""
        return [DraftState() for _ in items]

    def propose_on_device(self, requests: list) -> torch.Tensor | None:
        """Optional: greedy chains of `num_steps` tokens per request (`[B, num_steps]`
        target ids) left on the device, so that the host need not wait for them before the
        verification pass. None where this algorithm cannot (the engine calls `propose`).
        Only called when every request may emit `num_steps` more tokens. The ids must be
        in the target's vocabulary: nothing checks them before the pass. Default: None."""
        return None

    @abc.abstractmethod
    def propose(self, requests: list) -> list[DraftTree]:
        """A draft tree per request, from `request.token_ids` and `request.draft_state`.
        At most `num_draft_tokens - 1` nodes and depth `num_steps`."""

    @abc.abstractmethod
    def build_disagg_draft_input(
        self, batch: DraftBatch, last_tokens: list[int], records: list
    ) -> list[DraftState]:
        """Turn the metadata records received from prefill into this algorithm's first draft
        input on the decode side, one per record. Required: raise a clear error where it
        cannot proceed (an empty batch it cannot handle, a missing hidden state, a width or
        topk that disagrees with the handshake); never return None."""


def draft_states_from_records(
    algorithm: SpeculativeAlgorithm, batch: DraftBatch, last_tokens: list[int], records: list
) -> list[DraftState]:
    """The built-ins' hook body: check every record against the handshake and the
    algorithm's capabilities, and move its tensors to the engine's device."""
    if not len(records) == len(last_tokens) == len(batch.request_ids):
        raise DraftInputError(
            f"{len(records)} records, {len(last_tokens)} last tokens and "
            f"{len(batch.request_ids)} requests: they must match one to one"
        )
    caps, spec = algorithm.capabilities, batch.spec
    states = []
    for request_id, record in zip(batch.request_ids, records, strict=True):
        where = f"{algorithm.name} request {request_id}"
        hidden = record.hidden_states
        if caps.carries_hidden:
            if hidden is None:
                raise DraftInputError(f"{where}: the metadata has no hidden_states, needed")
            if spec.hidden_size is None or hidden.numel() != spec.hidden_size:
                raise DraftInputError(
                    f"{where}: hidden_states width {hidden.numel()} != spec_hidden_size "
                    f"{spec.hidden_size} agreed in the handshake"
                )
        elif hidden is not None:
            raise DraftInputError(f"{where}: hidden_states given, but it carries none")
        if caps.seeds_topk:
            for name in ("topk_p", "topk_index"):
                value = getattr(record, name)
                count = None if value is None else value.numel()
                if count != spec.topk or count != algorithm.settings.eagle_topk:
                    raise DraftInputError(
                        f"{where}: {name} has {count} entries; the handshake agreed topk "
                        f"{spec.topk} and this worker drafts with topk "
                        f"{algorithm.settings.eagle_topk}"
                    )
        states.append(
            DraftState(
                topk_p=_to(record.topk_p, batch.device) if caps.seeds_topk else None,
                topk_index=_to(record.topk_index, batch.device) if caps.seeds_topk else None,
                hidden=_to(hidden, batch.device) if caps.carries_hidden else None,
            )
        )
    return states


def _to(tensor, device):
    return tensor.to(device).clone()
