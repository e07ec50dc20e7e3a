"""EAGLE draft models: `LlamaForCausalLMEagle` (EAGLE) and `LlamaForCausalLMEagle3` (EAGLE-3).

Both predict the target's next token from the target's own features and the token embedding,
with one (or a few) decoder layers of their own and their own KV cache:

- EAGLE: `fc` maps [embedding, feature] (2 x hidden) to hidden, then decoder layers; the
  feature is the target's final hidden state (same width as the draft's).
- EAGLE-3: `fc` maps num_aux captured target layers (num_aux x target hidden) to the draft's
  hidden (each optionally normed first: `fc_norm`, legacy `use_aux_norm`); the first layer
  attends over [input_layernorm(embedding), hidden_norm(feature)] (2 x hidden wide). Its head
  may cover a smaller draft vocabulary; `d2t[i]` is the offset from draft id i to target id.

Two widths, never confused: `forward(..., from_target=True)` takes target features (the
capture width: target hidden, or num_aux x target hidden); with `from_target=False` it takes
the draft's own previous output (the recurrent width, `hidden_size`), which is also what
`forward` returns and what crosses prefill -> decode.

Checkpoints name the first layer `layers.0.*` or (legacy) `midlayer.*`; multi-layer drafts list
`layers.N.*`. A missing `embed_tokens` (and, with the full vocabulary, `lm_head`) is shared
from the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pdserve.engine.checkpoint.model_config import ModelConfig, UnsupportedModelError
from pdserve.engine.runtime.attention import AttentionBackend
from pdserve.engine.runtime.models.decoder import DecoderLayer, load_checkpoint
from pdserve.engine.runtime.models.layers import (
    Attention,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    rope_inverse_frequencies,
)

EAGLE_ARCHITECTURES = {"LlamaForCausalLMEagle": False, "LlamaForCausalLMEagle3": True}
DEFAULT_NUM_AUX = 3


@dataclass(frozen=True)
class EagleConfig:
    eagle3: bool
    layers: ModelConfig  # the draft's decoder-layer shapes (Llama style)
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # EAGLE-3: target layers whose outputs fc reads
    fc_norm: bool
    fc_bias: bool
    draft_vocab_size: int

    @property
    def hidden_size(self) -> int:
        return self.layers.hidden_size

    @property
    def capture(self) -> str | tuple[int, ...]:
        return self.aux_layer_ids if self.eagle3 else "final"

    @property
    def capture_width(self) -> int:
        if self.eagle3:
            return len(self.aux_layer_ids) * self.target_hidden_size
        return self.target_hidden_size

    @classmethod
    def from_dict(cls, hf: dict[str, Any], target: ModelConfig) -> EagleConfig:
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in EAGLE_ARCHITECTURES:
            raise UnsupportedModelError(
                f"draft architecture {arch!r} is not an EAGLE draft; expected one of "
                + ", ".join(EAGLE_ARCHITECTURES)
            )
        eagle3 = EAGLE_ARCHITECTURES[arch]
        if int(hf.get("hc_mult") or 1) > 1:
            raise UnsupportedModelError(
                f"drafts with hyper-connections (hc_mult {hf['hc_mult']}) are not implemented; "
                "their transfer width is sized (spec_hidden_size), their layers are not"
            )
        layers = ModelConfig.from_dict({**hf, "architectures": ["LlamaForCausalLM"]})
        target_hidden = int(hf.get("target_hidden_size") or target.hidden_size)
        if target_hidden != target.hidden_size:
            raise UnsupportedModelError(
                f"the draft was built for a target of hidden size {target_hidden}; this "
                f"target's is {target.hidden_size}"
            )
        if layers.vocab_size != target.vocab_size:
            raise UnsupportedModelError(
                f"draft vocab_size {layers.vocab_size} != target vocab_size {target.vocab_size}"
            )
        if not eagle3 and layers.hidden_size != target.hidden_size:
            raise UnsupportedModelError(
                f"an EAGLE draft concatenates the target's hidden state with its own: hidden "
                f"sizes must match (draft {layers.hidden_size}, target {target.hidden_size}); "
                "EAGLE-3 drafts map any width through fc"
            )
        draft_vocab = int(hf.get("draft_vocab_size") or layers.vocab_size)
        if not 0 < draft_vocab <= layers.vocab_size:
            raise UnsupportedModelError(
                f"draft_vocab_size {draft_vocab} must be in (0, {layers.vocab_size}]"
            )
        return cls(
            eagle3=eagle3,
            layers=layers,
            target_hidden_size=target_hidden,
            aux_layer_ids=_aux_layer_ids(hf, target.num_layers) if eagle3 else (),
            fc_norm=bool(hf.get("fc_norm", hf.get("use_aux_norm", False))),
            fc_bias=bool(hf.get("bias", False)),
            draft_vocab_size=draft_vocab,
        )


def _aux_layer_ids(hf: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    """num_aux from `num_aux_hidden_states`, else the length of
    `eagle_config.eagle_aux_hidden_state_layer_ids`, else 3; layers default to
    [2, L // 2, L - 3]."""
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    num_aux = hf.get("num_aux_hidden_states")
    if ids is None:
        last = num_target_layers
        ids = [2, last // 2, last - 3]
        if num_aux is not None and int(num_aux) != len(ids):
            raise UnsupportedModelError(
                f"num_aux_hidden_states is {num_aux} but no "
                "eagle_config.eagle_aux_hidden_state_layer_ids names the layers (the default "
                "[2, L // 2, L - 3] has 3)"
            )
    ids = tuple(int(i) for i in ids)
    if num_aux is not None and int(num_aux) != len(ids):
        raise UnsupportedModelError(
            f"num_aux_hidden_states {num_aux} != {len(ids)} layers in "
            "eagle_config.eagle_aux_hidden_state_layer_ids"
        )
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad or not ids:
        raise UnsupportedModelError(
            f"EAGLE-3 capture layers {list(ids)} must lie in [0, {num_target_layers}) for this "
            f"{num_target_layers}-layer target; set eagle_config.eagle_aux_hidden_state_layer_ids"
        )
    return ids


class Eagle3FirstLayer(nn.Module):
    """Attends over [input_layernorm(embedding), hidden_norm(feature)]; the residual stream
    is the feature."""

    def __init__(self, config: ModelConfig, rotary, backend: AttentionBackend):
        super().__init__()
        hidden, fused = config.hidden_size, backend.fused_elementwise
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, fused)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps, fused)
        self.self_attn = Attention(
            layer=0,
            hidden_size=hidden,
            input_size=2 * hidden,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            qkv_bias=config.qkv_bias,
            qk_norm_eps=None,
            sliding_window=None,
            rotary=rotary,
            backend=backend,
        )
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, fused)
        self.mlp = GatedMLP(hidden, config.intermediate_size, fused)

    def forward(self, embeds, hidden, positions, kv_pool, ctx):
        """`(h, residual)` like `DecoderLayer`."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        # NOTE: the residual add is not fused here: a fused norm would overwrite `hidden`,
        # which the caller keeps (tree drafting reads one parent's hidden state several times).
        residual = hidden + self.self_attn(x, positions, kv_pool, ctx)
        return self.mlp(self.post_attention_layernorm(residual)), residual


class EagleFirstLayer(DecoderLayer):
    """EAGLE's first layer: fc(embedding, feature) feeds a decoder layer without an input
    norm."""

    def __init__(self, config: ModelConfig, rotary, backend: AttentionBackend, fc_bias: bool):
        super().__init__(0, config, rotary, backend)
        del self.input_layernorm
        self.input_layernorm = nn.Identity()
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)

    def forward(self, embeds, hidden, positions, kv_pool, ctx):
        """`(h, residual)` like `DecoderLayer`."""
        h = self.fc(torch.cat([embeds, hidden], dim=-1))
        return super().forward(h, None, positions, kv_pool, ctx)


class EagleDraftModel(nn.Module):
    def __init__(self, config: EagleConfig, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.config = config
        layers = config.layers
        inv_freq, scaling = rope_inverse_frequencies(
            layers.hf_config, layers.rope_parameters, layers.head_dim
        )
        self.rotary = RotaryEmbedding(inv_freq, scaling, max_positions)
        self.embed_tokens = nn.Embedding(layers.vocab_size, layers.hidden_size)
        fused = backend.fused_elementwise
        if config.eagle3:
            first = Eagle3FirstLayer(layers, self.rotary, backend)
            self.fc = nn.Linear(config.capture_width, layers.hidden_size, bias=config.fc_bias)
            self.fc_norm = (
                nn.ModuleList(
                    RMSNorm(config.target_hidden_size, layers.rms_norm_eps, fused)
                    for _ in config.aux_layer_ids
                )
                if config.fc_norm
                else None
            )
            self.norm = RMSNorm(layers.hidden_size, layers.rms_norm_eps, fused)
        else:
            first = EagleFirstLayer(layers, self.rotary, backend, config.fc_bias)
            self.norm = None
        rest = [DecoderLayer(i, layers, self.rotary, backend) for i in range(1, layers.num_layers)]
        self.layers = nn.ModuleList([first, *rest])
        self.lm_head = nn.Linear(layers.hidden_size, config.draft_vocab_size, bias=False)
        if config.draft_vocab_size != layers.vocab_size:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        else:
            self.d2t = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, input_ids, positions, features, from_target: bool, kv_pool, ctx):
        """The recurrent hidden state `[T, hidden_size]` (before the final norm). `features`
        are target features (`from_target`) or this model's previous outputs."""
        if from_target and self.config.eagle3:
            features = self._fuse_aux(features)
        h, residual = self.layers[0](
            self.embed_tokens(input_ids), features, positions, kv_pool, ctx
        )
        for layer in self.layers[1:]:
            h, residual = layer(h, residual, positions, kv_pool, ctx)
        return h + residual

    def _fuse_aux(self, features: torch.Tensor) -> torch.Tensor:
        if self.fc_norm is not None:
            parts = features.split(self.config.target_hidden_size, dim=-1)
            features = torch.cat([n(p) for n, p in zip(self.fc_norm, parts, strict=True)], -1)
        return self.fc(features)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (float32)."""
        if self.norm is not None:
            hidden = self.norm(hidden)
        return self.lm_head(hidden).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def load_weights(self, weights, target_weight) -> None:
        """Load a draft checkpoint; share the target's embedding (and head) where the
        checkpoint has none (`target_weight(name)`: the target's whole tensor)."""
        seen: set[str] = set()

        def renamed():
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name.startswith("midlayer."):
                    name = "layers.0." + name.removeprefix("midlayer.")
                if name == "t2d":
                    continue  # the target -> draft map; d2t is the one drafting uses
                if name in ("fc.weight", "fc.bias") and not self.config.eagle3:
                    name = "layers.0." + name
                seen.add(name)
                yield name, tensor

        load_checkpoint(
            self,
            self.config.layers,
            renamed(),
            not_in_checkpoint={"embed_tokens.weight"}
            | ({"lm_head.weight"} if self.d2t is None else set()),
        )
        with torch.no_grad():
            if "embed_tokens.weight" not in seen:
                self.embed_tokens.weight.copy_(target_weight("model.embed_tokens.weight"))
            if "lm_head.weight" not in seen:
                if self.d2t is not None:
                    raise UnsupportedModelError(
                        "the draft has its own vocabulary (draft_vocab_size) but no lm_head"
                    )
                self.lm_head.weight.copy_(target_weight("lm_head.weight"))
        if self.d2t is not None and "d2t" not in seen:
            raise UnsupportedModelError("the draft has draft_vocab_size but no d2t tensor")
        if self.d2t is not None:
            # NOTE: drafted ids reach the target's embedding unchecked (they may never leave
            # the device before the verification pass): the map must stay in its vocabulary.
            vocab = self.config.layers.vocab_size
            target_ids = self.to_target_ids(torch.arange(len(self.d2t), device=self.d2t.device))
            outside = ((target_ids < 0) | (target_ids >= vocab)).nonzero().flatten()
            if len(outside):
                raise UnsupportedModelError(
                    f"d2t maps {len(outside)} draft ids outside the target vocabulary "
                    f"[0, {vocab}), the first: draft id {int(outside[0])}"
                )
