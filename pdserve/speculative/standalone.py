"""STANDALONE: a small language model of the same vocabulary drafts for the target. It has its
own KV (moved prefill -> decode with the target's) and carries no hidden state: hidden_states
is None end to end, so target and draft hidden sizes are independent."""

from __future__ import annotations

from typing import ClassVar

from pdserve.engine.checkpoint.model_config import ModelConfig
from pdserve.engine.runtime.loader import load_model
from pdserve.speculative.algorithm import Capabilities, draft_states_from_records
from pdserve.speculative.draft_model import DraftModelAlgorithm, DraftNet
from pdserve.speculative.state import ExtendItem


class _LanguageModelNet(DraftNet):
    def __init__(self, model):
        self.model = model

    def forward(self, ids, positions, features, from_target, kv_pool, ctx):
        return self.model(ids, positions, kv_pool, ctx)

    def logits(self, hidden):
        return self.model.compute_logits(hidden)


class Standalone(DraftModelAlgorithm):
    name: ClassVar[str] = "STANDALONE"
    capabilities: ClassVar[Capabilities] = Capabilities(
        has_draft_kv=True, carries_hidden=False, seeds_topk=True
    )
    offset = 1  # the draft reads x_i at position i, like any language model

    def load_net(self, engine) -> DraftNet:
        self.config = ModelConfig.from_dict(self.draft_config())
        if self.config.vocab_size != engine.model_config.vocab_size:
            raise ValueError(
                f"STANDALONE draft vocab_size {self.config.vocab_size} != target vocab_size "
                f"{engine.model_config.vocab_size}: the draft must share the tokenizer"
            )
        if self.config.sliding_window is not None:
            raise ValueError("a STANDALONE draft with sliding-window attention is not supported")
        positions = engine.max_model_len + self.lookahead_slots()
        model = load_model(
            self.draft_dir(),
            self.config,
            engine.device,
            engine.dtype,
            positions,
            engine.attention_backend,
        )
        return _LanguageModelNet(model)

    def draft_kv_shape(self) -> tuple[int, int, int]:
        return self.config.num_layers, self.config.num_kv_heads, self.config.head_dim

    def extend_tokens(self, item: ExtendItem) -> tuple[list[int], int]:
        # The draft covers [0, start] before (x_start included) and [0, start + n] after;
        # a fresh sequence starts with x_0.
        if item.start == 0:
            return [item.request.token_ids[0], *item.next_tokens], 0
        return list(item.next_tokens), item.start + 1

    def build_disagg_draft_input(self, batch, last_tokens, records):
        return draft_states_from_records(self, batch, last_tokens, records)
