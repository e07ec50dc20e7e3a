"""Reference attention in plain torch (CPU and CUDA): the oracle other backends are tested
against. Multi-token sequences (prefill, possibly after a cached prefix) run one by one;
single-token (decode) sequences run as one padded, batched call.

Grouped-query attention without copying K/V: the `heads / kv_heads` query heads that share a
KV head are laid out as extra query rows of that KV head, so `scaled_dot_product_attention`
sees as many heads as the cache has and no expanded K/V is materialized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pdserve.engine.runtime.attention.backend import AttentionBackend, RotaryTables
from pdserve.engine.runtime.attention.context import AttentionContext
from pdserve.engine.runtime.kv_pool import KVPool


def _allowed_keys(
    query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Causal mask (and sliding window): query at position p sees keys p-window < j <= p."""
    allowed = key_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        allowed &= key_pos[None, :] > query_pos[:, None] - sliding_window
    return allowed


# NOTE: cuDNN attention is left out: it builds a new execution plan for every new shape, and
# the reference runs ever-changing shapes (measured on an H100: ~3 ms of host time per call,
# most of a decode step). The memory-efficient kernel takes arbitrary masks at no such cost.
_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


class TorchReferenceBackend(AttentionBackend):
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: KVPool,
        ctx: AttentionContext,
        *,
        rotary: RotaryTables,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        q, k = rotary(positions, q, k)
        kv_pool.store(layer, ctx.slot_mapping, k, v)
        out = torch.empty_like(q)
        k_cache, v_cache = kv_pool.k[layer], kv_pool.v[layer]
        with sdpa_kernel(_SDPA_BACKENDS):
            for i in ctx.prefill_seqs:
                rows = slice(ctx.query_starts[i], ctx.query_starts[i] + ctx.query_lens[i])
                out[rows] = _prefill_one(q[rows], k_cache, v_cache, ctx, i, scale, sliding_window)
            if ctx.decode_token_rows.numel():
                out[ctx.decode_token_rows] = _decode_batch(
                    q[ctx.decode_token_rows], k_cache, v_cache, ctx, scale, sliding_window
                )
        return out


def _prefill_one(q, k_cache, v_cache, ctx, seq, scale, sliding_window):
    kv_len, q_len = ctx.kv_lens[seq], ctx.query_lens[seq]
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    pages = ctx.page_table[seq, : -(-kv_len // ctx.page_size)]
    keys = k_cache[pages].flatten(0, 1)[:kv_len].transpose(0, 1)  # [kv_heads, kv_len, head_dim]
    values = v_cache[pages].flatten(0, 1)[:kv_len].transpose(0, 1)
    if ctx.masks is not None and seq in ctx.masks:
        # NOTE: an explicit (tree) mask over the last keys; the engine refuses speculation
        # with sliding windows.
        tail = ctx.masks[seq]
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device)
        mask[:, kv_len - tail.shape[1] :] = tail
        mask = mask.repeat(group, 1)
    else:
        key_pos = torch.arange(kv_len, device=q.device)
        mask = _allowed_keys(key_pos[kv_len - q_len :], key_pos, sliding_window).repeat(group, 1)
    grouped_q = q.transpose(0, 1).reshape(kv_heads, group * q_len, head_dim)
    attn = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=mask, scale=scale)
    return attn.reshape(num_heads, q_len, head_dim).transpose(0, 1)


def _decode_batch(q, k_cache, v_cache, ctx, scale, sliding_window):
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    max_len = ctx.max_decode_kv_len
    pages = ctx.page_table[ctx.decode_table_rows, : -(-max_len // ctx.page_size)]  # [D, P]
    keys = k_cache[pages].flatten(1, 2)[:, :max_len].transpose(1, 2)  # [D, kv_heads, L, dim]
    values = v_cache[pages].flatten(1, 2)[:, :max_len].transpose(1, 2)
    key_pos = torch.arange(max_len, device=q.device)
    mask = _allowed_keys(ctx.decode_kv_lens - 1, key_pos, sliding_window)  # [D, L]
    grouped_q = q.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    attn = F.scaled_dot_product_attention(
        grouped_q, keys, values, attn_mask=mask[:, None, None, :], scale=scale
    )
    return attn.reshape(num_seqs, num_heads, head_dim)
