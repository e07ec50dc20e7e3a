"""The decoder-only transformer behind Llama, Mistral, Qwen2 and Qwen3.

The four architectures are one network; their differences (q/k/v bias, per-head q/k norm,
head_dim, sliding window, tied embeddings, RoPE scaling) are fields of `ModelConfig`. Module
names mirror the HF checkpoints, so loading maps names one to one except for the fused q/k/v
and gate/up projections. Under tensor parallelism (`tp`) the layers are the rank's share and
loading reads only the rank's slice of each tensor (`ModelSplit.checkpoint_slice`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.checkpoint.model_config import ModelConfig
from pdserve.engine.parallel.tensor_parallel import PendingSum, TensorParallel
from pdserve.engine.runtime.attention import AttentionBackend, AttentionContext
from pdserve.engine.runtime.kv_pool import KVPool
from pdserve.engine.runtime.models.layers import (
    Attention,
    GatedMLP,
    RotaryEmbedding,
    VocabParallelEmbedding,
    rope_inverse_frequencies,
    stream_norm,
)

# checkpoint projection -> (fused module, index of its slice)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class MissingWeightsError(ValueError):
    """The checkpoint lacks tensors the model needs."""


@dataclass
class MicroBatch:
    """One of the two halves of a pass run as two (`DecoderModel.forward_two_batches`): its
    attention metadata (its new tokens' positions among them), and where its residual stream
    stands (`h`, or the all-reduce that will give it, plus `residual`)."""

    ctx: AttentionContext
    h: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    pending: PendingSum | None = None

    def hidden(self) -> torch.Tensor:
        """`h`, once its all-reduce (if one is running) has summed it."""
        if self.pending is not None:
            self.h, self.pending = self.pending.wait(), None
        return self.h

    def stream(self) -> torch.Tensor:
        """The residual stream's value (`h + residual`)."""
        h = self.hidden()
        return h if self.residual is None else h + self.residual


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks over a residual stream carried beside the hidden
    state, so that each residual add fuses into the norm after it: a layer takes and returns
    `(h, residual)`, the stream's value being `h + residual`. Under tensor parallelism the
    `h` a block writes is this rank's partial sum, which the norm after it sums (with the
    add and the norm, `SummedRMSNorm`); the embedding sums its own."""

    def __init__(
        self,
        layer: int,
        config: ModelConfig,
        rotary,
        backend: AttentionBackend,
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        self.tp = tp
        fused, hidden, eps = backend.fused_elementwise, config.hidden_size, config.rms_norm_eps
        self.input_layernorm = stream_norm(hidden, eps, fused, tp if layer else None)
        self.self_attn = Attention(
            layer=layer,
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            qkv_bias=config.qkv_bias,
            qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
            sliding_window=config.sliding_window,
            rotary=rotary,
            backend=backend,
            tp=tp,
        )
        self.post_attention_layernorm = stream_norm(hidden, eps, fused, tp)
        self.mlp = GatedMLP(hidden, config.intermediate_size, fused, tp)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_pool: KVPool,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual` None for the first layer (the stream is `h`).

        NOTE: fused norms update the residual in place: the tensor passed as `residual`, or
        as `h` with residual None, is overwritten.
        """
        h, residual = self._input_norm(h, residual)
        h = self.self_attn(h, positions, kv_pool, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def _input_norm(self, h, residual, summed: bool = False):
        """`summed`: `h` is summed already (the norm only norms)."""
        norm = self.input_layernorm.normed if summed else self.input_layernorm
        if residual is None:
            return norm(h), h
        return norm(h, residual)

    def forward_two_batches(self, halves: Sequence[MicroBatch], kv_pool: KVPool) -> None:
        """Both halves through this layer (tensor parallelism), each block's all-reduce left
        running while the other half computes: attention of the first half, attention of
        the second while the first's sum runs, the first's MLP while the second's sum runs,
        and so on into the next layer. Leaves each half's output pending."""
        for half in halves:
            h, half.residual = self._input_norm(half.hidden(), half.residual, summed=True)
            partial = self.self_attn(h, half.ctx.positions, kv_pool, half.ctx)
            half.pending = self.tp.all_reduce_async(partial)
        for half in halves:
            h, half.residual = self.post_attention_layernorm.normed(half.hidden(), half.residual)
            half.pending = self.tp.all_reduce_async(self.mlp(h))


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        max_positions: int,
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        inv_freq, scaling = rope_inverse_frequencies(
            config.hf_config, config.rope_parameters, config.head_dim
        )
        self.rotary = RotaryEmbedding(inv_freq, scaling, max_positions)
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, config.hidden_size)
            if tp is None
            else VocabParallelEmbedding(tp, config.hidden_size)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(i, config, self.rotary, backend, tp) for i in range(config.num_layers)
        )
        self.norm = stream_norm(
            config.hidden_size, config.rms_norm_eps, backend.fused_elementwise, tp
        )

    def forward(self, input_ids, positions, kv_pool, ctx, capture: tuple[int, ...] = ()):
        """Normed final hidden states, and the outputs of the `capture` layers (in the order
        given; what EAGLE-3 drafts read)."""
        h, residual = self.embed_tokens(input_ids), None
        captured: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.layers):
            h, residual = layer(h, residual, positions, kv_pool, ctx)
            if index in capture:
                captured[index] = self.norm.stream(h, residual)
        h, _ = self.norm(h, residual)
        return h, [captured[i] for i in capture]

    def forward_two_batches(
        self,
        input_ids: Sequence[torch.Tensor],
        halves: Sequence[MicroBatch],
        kv_pool: KVPool,
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward` of a pass split in two by tokens (`input_ids[i]` are `halves[i]`'s), the
        halves' rows joined again: each all-reduce of one half runs while the other half
        computes (tensor parallelism only). The embedding runs once for both."""
        embedded = self.embed_tokens(torch.cat(list(input_ids)))
        for half, h in zip(halves, embedded.split([len(i) for i in input_ids]), strict=True):
            half.h = h
        captured: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.layers):
            layer.forward_two_batches(halves, kv_pool)
            if index in capture:
                captured[index] = torch.cat([half.stream() for half in halves])
        h = torch.cat([self.norm.normed(half.hidden(), half.residual)[0] for half in halves])
        return h, [captured[i] for i in capture]


class CausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        max_positions: int,
        tp: TensorParallel | None = None,
    ):
        """`tp`: this rank's place in a tensor-parallel group (None: the whole model)."""
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = DecoderModel(config, backend, max_positions, tp)
        vocab_rows = config.vocab_size if tp is None else tp.split.vocab_per_rank
        self.lm_head = nn.Linear(config.hidden_size, vocab_rows, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: KVPool,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` of the flattened batch."""
        return self.model(input_ids, positions, kv_pool, ctx)[0]

    def forward_capture(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: KVPool,
        ctx: AttentionContext,
        layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states, and the `layers`' outputs side by side `[T, len * hidden]`."""
        hidden, captured = self.model(input_ids, positions, kv_pool, ctx, tuple(layers))
        return hidden, torch.cat(captured, dim=-1)

    def forward_two_batches(
        self,
        input_ids: Sequence[torch.Tensor],
        halves: Sequence[MicroBatch],
        kv_pool: KVPool,
        layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` (or `forward_capture` of `layers`) of a pass split in two by tokens,
        each half's all-reduces overlapping the other half's compute (`DecoderModel`)."""
        hidden, captured = self.model.forward_two_batches(input_ids, halves, kv_pool, layers)
        return hidden, torch.cat(captured, dim=-1) if captured else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (under tensor parallelism every rank computes its
        slice; all of them gather the rest)."""
        logits = self.lm_head(hidden).float()
        return logits if self.tp is None else self.tp.gather_vocab(logits)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in (this rank's slices of them under tensor parallelism);
        raise if any parameter stayed unset."""
        tied = self.config.tie_word_embeddings
        load_checkpoint(
            self,
            self.config,
            ((n, t) for n, t in weights if not (tied and n == "lm_head.weight")),
            not_in_checkpoint={"lm_head.weight"} if tied else set(),
            tp=self.tp,
        )


@torch.no_grad()
def load_checkpoint(
    module: nn.Module,
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    not_in_checkpoint: set[str] = frozenset(),
    tp: TensorParallel | None = None,
) -> None:
    """Copy checkpoint tensors (HF names; q/k/v and gate/up separate) into `module`'s
    parameters (fused) and buffers; raise if a tensor has no place or a parameter stayed
    unset (except those named in `not_in_checkpoint`). A tensor may be a `CheckpointTensor`
    (read only in part); with `tp`, each parameter takes this rank's slice."""
    params = dict(module.named_parameters())
    params.update(module.named_buffers())
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        target, part = _param_for(name)
        if target not in params:
            raise MissingWeightsError(f"checkpoint tensor {name!r} has no place in the model")
        param = params[target]
        dest = param if part is None else param.narrow(0, *_slice_of(config, tp, target, part))
        piece = tp.split.checkpoint_slice(target, part, tp.rank) if tp is not None else None
        if piece is not None:
            dim, start, length = piece
            full = _shape_with(dest.shape, dim, _full_size(config, target, part))
            dest = dest.narrow(dim, 0, length)  # NOTE: the last vocabulary slice may be short
        else:
            full = tuple(dest.shape)
        if tuple(tensor.shape) != full:
            raise MissingWeightsError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != model {full}"
            )
        if piece is not None:
            tensor = tensor.narrow(dim, start, length)
        dest.copy_(_materialized(tensor))
        loaded.add(f"{target}:{part}")
    expected = set()
    for target, _ in module.named_parameters():
        if target.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            expected.update(f"{target}:{i}" for i in range(3))
        elif target.endswith("gate_up_proj.weight"):
            expected.update(f"{target}:{i}" for i in range(2))
        elif target not in not_in_checkpoint:
            expected.add(f"{target}:None")
    missing = sorted(expected - loaded)
    if missing:
        raise MissingWeightsError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")


def _param_for(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, index = _FUSED[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), index
    return name, None


def _slice_of(c: ModelConfig, tp: TensorParallel | None, target: str, part: int) -> tuple[int, int]:
    """Where part `part` sits in a fused parameter (of this rank's size under `tp`)."""
    heads, kv_heads, intermediate = c.num_heads, c.num_kv_heads, c.intermediate_size
    if tp is not None:
        s = tp.split
        heads, kv_heads, intermediate = (
            s.heads_per_rank,
            s.kv_heads_per_rank,
            s.intermediate_per_rank,
        )
    if "qkv_proj" in target:
        q, kv = heads * c.head_dim, kv_heads * c.head_dim
        return [(0, q), (q, kv), (q + kv, kv)][part]
    return (part * intermediate, intermediate)


def _full_size(c: ModelConfig, target: str, part: int | None) -> int:
    """The whole length of the dimension tensor parallelism splits, in the checkpoint."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    if "qkv_proj" in target:
        return q if part == 0 else kv
    if "o_proj" in target:
        return q
    if "gate_up_proj" in target or "down_proj" in target:
        return c.intermediate_size
    return c.vocab_size


def _shape_with(shape, dim: int, size: int) -> tuple[int, ...]:
    return tuple(size if i == dim else n for i, n in enumerate(shape))


def _materialized(tensor) -> torch.Tensor:
    """A tensor; a `CheckpointTensor` is read now (only the slice it was narrowed to)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.read()
