"""EAGLE and EAGLE-3: a small draft head over the target's own features.

The prefill side runs the draft over the prompt (`extend`) and ships the draft KV with the
target's, plus the draft's top-k and hidden state at the last position (the metadata record).
The decode side rebuilds the first draft input from that record (`build_disagg_draft_input`).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from pdserve.engine.checkpoint.weights import iterate_weights
from pdserve.engine.runtime.forward_batch import Capture
from pdserve.engine.runtime.loader import default_dtype
from pdserve.engine.runtime.models.eagle import EagleConfig, EagleDraftModel
from pdserve.speculative.algorithm import Capabilities, draft_states_from_records
from pdserve.speculative.draft_model import DraftModelAlgorithm, DraftNet


class _EagleNet(DraftNet):
    def __init__(self, model: EagleDraftModel):
        self.model = model

    def forward(self, ids, positions, features, from_target, kv_pool, ctx):
        return self.model(ids, positions, features, from_target, kv_pool, ctx)

    def logits(self, hidden):
        return self.model.compute_logits(hidden)

    def to_target_ids(self, draft_ids):
        return self.model.to_target_ids(draft_ids)

    def feature_width(self):
        return self.model.config.capture_width


class Eagle(DraftModelAlgorithm):
    name: ClassVar[str] = "EAGLE"
    capabilities: ClassVar[Capabilities] = Capabilities(
        has_draft_kv=True, carries_hidden=True, seeds_topk=True
    )
    architecture: ClassVar[str] = "LlamaForCausalLMEagle"

    def load_net(self, engine) -> DraftNet:
        self.config = EagleConfig.from_dict(self.draft_config(), engine.model_config)
        if self.config.eagle3 != (self.name == "EAGLE3"):
            raise ValueError(
                f"--speculative-algorithm {self.name} needs a {self.architecture} draft; "
                f"{self.settings.draft_model_path} is "
                f"{'LlamaForCausalLMEagle3' if self.config.eagle3 else 'LlamaForCausalLMEagle'}"
            )
        positions = engine.max_model_len + self.lookahead_slots()
        with torch.device(engine.device), default_dtype(engine.dtype):
            model = EagleDraftModel(self.config, engine.attention_backend, positions)
        model.load_weights(iterate_weights(self.draft_dir(), engine.device), engine.target_weight)
        return _EagleNet(model.eval())

    def target_capture(self) -> Capture:
        capture = self.config.capture
        return Capture.final() if capture == "final" else Capture.layers(capture)

    def draft_kv_shape(self) -> tuple[int, int, int]:
        layers = self.config.layers
        return self.net.model.num_layers, layers.num_kv_heads, layers.head_dim

    def build_disagg_draft_input(self, batch, last_tokens, records):
        return draft_states_from_records(self, batch, last_tokens, records)


class Eagle3(Eagle):
    name: ClassVar[str] = "EAGLE3"
    architecture: ClassVar[str] = "LlamaForCausalLMEagle3"
