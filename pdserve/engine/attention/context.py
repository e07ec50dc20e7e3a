"""Attention metadata for one forward pass, built once per step by the model runner.

Tokens of all sequences are flattened into one `[T]` batch (prefill chunks and single decode
tokens mixed). Sequence i owns rows `query_starts[i] : query_starts[i] + query_lens[i]`; after
this step it has `kv_lens[i]` tokens of KV, the last `query_lens[i]` of them new. Decode-shaped
sequences (one new token) are also described by dense tensors, so a backend can run them as one
batched call and a CUDA graph can later capture that path with static shapes.

Speculative decoding adds two things: explicit positions (a tree node's position is its depth,
while its KV goes to the next free slot) and per-sequence masks (a tree node sees the cached
prefix, its ancestors and itself). New tokens always occupy consecutive slots after the
`num_computed` cached ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionContext:
    page_size: int
    positions: torch.Tensor  # [T] position of each new token
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    query_starts: list[int]
    query_lens: list[int]
    kv_lens: list[int]
    page_table: torch.Tensor  # [B, max_pages] page ids (padding rows/cols are 0)
    # Sequences with more than one new token, run one by one by the reference backend.
    prefill_seqs: list[int]
    # Sequences with exactly one new token: their token rows, page-table rows and KV lengths.
    decode_token_rows: torch.Tensor  # [D]
    decode_page_table: torch.Tensor  # [D, max_pages]
    decode_kv_lens: torch.Tensor  # [D]
    max_decode_kv_len: int
    # Sequence index -> [query_len, kv_len] bool: which cached slots each new token may see
    # (replaces the causal mask). Such sequences run on the multi-token path.
    masks: dict[int, torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(
        cls,
        *,
        page_size: int,
        pages: list[list[int]],
        num_computed: list[int],
        query_lens: list[int],
        device: torch.device,
        positions: list[list[int]] | None = None,
        masks: dict[int, torch.Tensor] | None = None,
    ) -> AttentionContext:
        """Metadata for sequences that own `pages` and compute `query_lens` new tokens after
        `num_computed` cached ones, at slots num_computed.. and (unless `positions` says
        otherwise) the same positions."""
        num_seqs = len(query_lens)
        kv_lens = [c + q for c, q in zip(num_computed, query_lens, strict=True)]
        max_pages = max((len(p) for p in pages), default=1) or 1
        table = torch.tensor([p + [0] * (max_pages - len(p)) for p in pages], dtype=torch.int64)
        query_starts = [0] * num_seqs
        for i in range(1, num_seqs):
            query_starts[i] = query_starts[i - 1] + query_lens[i - 1]
        storage = torch.cat(
            [
                torch.arange(c, c + q, dtype=torch.int64)
                for c, q in zip(num_computed, query_lens, strict=True)
            ]
        )
        seq_of_token = torch.repeat_interleave(
            torch.arange(num_seqs), torch.tensor(query_lens, dtype=torch.int64)
        )
        slots = table[seq_of_token, storage // page_size] * page_size + storage % page_size
        if positions is not None:
            storage = torch.tensor([p for seq in positions for p in seq], dtype=torch.int64)
        masks = masks or {}
        decode = [i for i, q in enumerate(query_lens) if q == 1 and i not in masks]
        decode_index = torch.tensor(decode, dtype=torch.int64)
        decode_rows = torch.tensor([query_starts[i] for i in decode], dtype=torch.int64)
        decode_kv = torch.tensor([kv_lens[i] for i in decode], dtype=torch.int64)

        def to_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return cls(
            page_size=page_size,
            positions=to_device(storage),
            slot_mapping=to_device(slots),
            query_starts=query_starts,
            query_lens=list(query_lens),
            kv_lens=kv_lens,
            page_table=to_device(table),
            prefill_seqs=[i for i, q in enumerate(query_lens) if q > 1 or i in masks],
            decode_token_rows=to_device(decode_rows),
            decode_page_table=to_device(table[decode_index]),
            decode_kv_lens=to_device(decode_kv),
            max_decode_kv_len=max((kv_lens[i] for i in decode), default=0),
            masks={i: to_device(m) for i, m in masks.items()} or None,
        )
