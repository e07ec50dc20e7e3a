"""Attention through Triton kernels: rotary + KV write in one kernel, then one launch for all
decode sequences (paged, split-KV) and one for all extend sequences (ragged, paged).

K/V are read in place through the page table; nothing is gathered or padded. See
`pdserve.engine.kernels` for the kernels and their numerics.
"""

from __future__ import annotations

import torch

from pdserve.engine.kernels.decode_attention import num_splits_for, paged_decode_attention
from pdserve.engine.kernels.extend_attention import paged_extend_attention
from pdserve.engine.kernels.rope_store import rope_and_store
from pdserve.engine.runtime.attention.backend import AttentionBackend, RotaryTables
from pdserve.engine.runtime.attention.context import AttentionContext
from pdserve.engine.runtime.kv_pool import KVPool


class TritonBackend(AttentionBackend):
    fused_elementwise = True
    graph_capturable = True

    def __init__(self, device: torch.device):
        # The interpreter (CPU) has no multiprocessors; any count gives the same results.
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 4
        )

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
        k_cache, v_cache = kv_pool.k[layer], kv_pool.v[layer]
        rope_and_store(
            q, k, v, positions, ctx.slot_mapping, rotary.cos, rotary.sin, k_cache, v_cache
        )
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        paged_extend_attention(
            q,
            k_cache,
            v_cache,
            out,
            ctx.page_table,
            ctx.seq_table_rows,
            ctx.prefill_index,
            ctx.seq_query_starts,
            ctx.seq_query_lens,
            ctx.seq_kv_lens,
            ctx.max_prefill_query_len,
            scale=scale,
            sliding_window=sliding_window,
            mask_data=ctx.mask_data,
            mask_offsets=ctx.mask_offsets,
            mask_widths=ctx.mask_widths,
            rows_per_seq=ctx.rows_per_seq,
        )
        num_decode = ctx.decode_token_rows.shape[0]
        paged_decode_attention(
            q,
            k_cache,
            v_cache,
            ctx.page_table,
            ctx.decode_table_rows,
            ctx.decode_kv_lens,
            ctx.decode_token_rows,
            out,
            scale=scale,
            sliding_window=sliding_window,
            num_splits=num_splits_for(num_decode, kv_pool.num_kv_heads, self.num_sms),
        )
        return out
