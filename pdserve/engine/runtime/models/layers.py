"""Building blocks shared by every decoder model: norm, rotary embedding, attention, MLP.

Numerics follow transformers' implementations (norm in float32 then cast back; rotary tables
computed in float32 and cast to the activation dtype) so greedy outputs match it token for token.
Q/K/V and gate/up projections are fused into one matmul each; the weight loader fills the
fused weights from the checkpoint's separate tensors.

Tensor parallelism is a choice of layers, not branches in the model (`tensor_parallel.py`):
given a `TensorParallel`, attention builds its rank's heads, the MLP its rank's slice, the
projections back into the residual stream are `RowParallelLinear` (this rank's partial sum),
and the norms that read the stream after them are `SummedRMSNorm` (the all-reduce, then the
residual add and the norm: one kernel where the one-shot all-reduce takes the tensor);
without one, every layer is the plain single-device module.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.parallel.tensor_parallel import TensorParallel
from pdserve.engine.runtime.attention import AttentionBackend, AttentionContext
from pdserve.engine.runtime.kv_pool import KVPool


class RMSNorm(nn.Module):
    """transformers' RMSNorm; given a residual, adds it first and returns the sum as well
    (the new residual stream). `fused`: one Triton kernel instead of torch ops (same
    numerics; the sum is then written into `residual` in place)."""

    def __init__(self, dim: int, eps: float, fused: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = fused
        if fused:
            # NOTE: Triton is optional (a GPU or the interpreter); only fused layers need it.
            from pdserve.engine.kernels.norm import rms_norm

            self._rms_norm = rms_norm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.normed(x, residual)

    def normed(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The norm of `x` (+ `residual`, then returned as well), `x` taken as it is."""
        if self.fused:
            return self._fused(x, residual)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def stream(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The residual stream's value that this norm would read from `(x, residual)` (a new
        tensor; neither is changed)."""
        return x + residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def _fused(self, x, residual):
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if residual is None:
            return self._rms_norm(rows, self.weight, self.eps).view(shape)
        # NOTE: a view, so that the in-place update reaches the caller's residual.
        out, _ = self._rms_norm(rows, self.weight, self.eps, residual.view(-1, shape[-1]))
        return out.view(shape), residual


class SummedRMSNorm(RMSNorm):
    """The norm after a row-parallel projection (tensor parallelism): its input is this
    rank's partial sum, which it sums over the ranks first (`TensorParallel.sum_and_norm`:
    with the residual add and the norm in the same kernel where it can)."""

    def __init__(self, dim: int, eps: float, fused: bool, tp: TensorParallel):
        super().__init__(dim, eps, fused)
        self.tp = tp

    def forward(self, x, residual=None):
        return self.tp.sum_and_norm(x, residual, self)

    def stream(self, x, residual):
        # NOTE: a clone, since NCCL sums in place and `x` is summed again by its next norm.
        return self.tp.all_reduce(x.clone()) + residual


def stream_norm(dim: int, eps: float, fused: bool, tp: TensorParallel | None) -> RMSNorm:
    """A norm of the residual stream after row-parallel writes: summing under `tp`."""
    return RMSNorm(dim, eps, fused) if tp is None else SummedRMSNorm(dim, eps, fused, tp)


def rope_inverse_frequencies(
    hf_config: dict[str, Any], rope_parameters: dict[str, Any], head_dim: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's RoPE type.

    The default type is computed here; scaled types (llama3, linear, yarn, ...) come from
    transformers' own implementations so they cannot drift from the reference.
    """
    rope_type = rope_parameters["rope_type"]
    if rope_type == "default":
        base = float(rope_parameters["rope_theta"])
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponents), 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE depends on the sequence length and is not supported")
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    fields = dict(hf_config)
    hf = AutoConfig.for_model(fields.pop("model_type"), **fields)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        # NOTE: scaled RoPE types compute inv_freq on the CPU; follow the positions' device
        # (the model is built under a `torch.device` context).
        freqs = torch.outer(positions, inv_freq.to(positions.device))
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", angles.cos() * scaling, persistent=False)
        self.register_buffer("sin", angles.sin() * scaling, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RowParallelLinear(nn.Linear):
    """A projection whose input is split over the ranks (their heads, their MLP slice): each
    multiplies its slice, giving this rank's partial sum of the output. Whoever reads it next
    adds the partial sums up (`SummedRMSNorm`), so that the all-reduce can fuse with what
    follows it."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)


def output_projection(in_features: int, out_features: int, tp: TensorParallel | None):
    """The projection back into the residual stream: row-parallel under tensor parallelism
    (its output unsummed)."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=False)
    return RowParallelLinear(in_features, out_features)


class VocabParallelEmbedding(nn.Module):
    """The embedding's rows of one rank's vocabulary slice: ids outside it look up zeros, and
    the all-reduce fills every row from the rank that owns the id."""

    def __init__(self, tp: TensorParallel, hidden_size: int):
        super().__init__()
        self.tp = tp
        self.start = tp.rank * tp.split.vocab_per_rank
        self.weight = nn.Parameter(torch.zeros(tp.split.vocab_per_rank, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(outside[:, None], 0))


class Attention(nn.Module):
    def __init__(
        self,
        *,
        layer: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        qk_norm_eps: float | None,
        sliding_window: int | None,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        input_size: int | None = None,
        tp: TensorParallel | None = None,
    ):
        """input_size: width of what q/k/v are projected from (default hidden_size). With
        `tp`, the heads are this rank's (`ModelSplit`)."""
        super().__init__()
        if tp is not None:
            num_heads, num_kv_heads = tp.split.heads_per_rank, tp.split.kv_heads_per_rank
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        in_features = input_size or hidden_size
        self.qkv_proj = nn.Linear(in_features, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = output_projection(self.q_size, hidden_size, tp)
        # Qwen3 normalizes each head of q and k before the rotary embedding.
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.sliding_window = sliding_window
        self.scale = head_dim**-0.5
        # NOTE: plain attributes, not submodules: shared by every layer, no weights.
        self.__dict__["rotary"] = rotary
        self.__dict__["backend"] = backend

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: KVPool,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """The output (under tensor parallelism, this rank's partial sum of it)."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.backend.forward(
            self.layer,
            q,
            k,
            v,
            positions,
            kv_pool,
            ctx,
            rotary=self.rotary,
            scale=self.scale,
            sliding_window=self.sliding_window,
        )
        return self.o_proj(out.reshape(-1, self.q_size))


class GatedMLP(nn.Module):
    """SwiGLU MLP; `fused`: silu(gate) * up in one Triton kernel (same numerics)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        fused: bool = False,
        tp: TensorParallel | None = None,
    ):
        """With `tp`, the rank's slice of the intermediate dimension."""
        super().__init__()
        if tp is not None:
            intermediate_size = tp.split.intermediate_per_rank
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = output_projection(intermediate_size, hidden_size, tp)
        self.fused = fused
        if fused:
            from pdserve.engine.kernels.activation import silu_and_mul

            self._silu_and_mul = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The output (under tensor parallelism, this rank's partial sum of it)."""
        gate_up = self.gate_up_proj(x)
        if self.fused:
            rows = self._silu_and_mul(gate_up.reshape(-1, gate_up.shape[-1]))
            return self.down_proj(rows.view(*gate_up.shape[:-1], self.intermediate_size))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
