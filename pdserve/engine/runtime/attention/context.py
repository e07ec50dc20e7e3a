"""Attention metadata for one forward pass, built once per step by the model runner.

Tokens of all sequences are flattened into one `[T]` batch (prefill chunks and single decode
tokens mixed). Sequence i owns rows `query_starts[i] : query_starts[i] + query_lens[i]`; after
this step it has `kv_lens[i]` tokens of KV, the last `query_lens[i]` of them new.

Sequences split into two groups, each run by one batched call of a backend:
- decode: exactly one new token and no explicit mask; described by dense `[D]` tensors so a
  CUDA graph can later capture that path with static shapes;
- extend: several new tokens (prefill chunks, speculative verification), or an explicit mask.

Speculative decoding adds two things: explicit positions (a tree node's position is its depth,
while its KV goes to the next free slot) and per-sequence masks (a tree node sees the cached
prefix, its ancestors and itself). A mask covers a sequence's last keys only (`[new tokens,
width]`); the keys before them are visible to every new token. New tokens always occupy
consecutive slots after the `num_computed` cached ones.

Every integer tensor travels to the device in one copy (`_pack`): a step's metadata is a few
kilobytes, and each separate copy costs host time that a decode step cannot spare.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from pdserve.engine.runtime.host_ints import host_ints


@dataclass
class AttentionContext:
    page_size: int
    positions: torch.Tensor  # [T] position of each new token
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    query_starts: list[int]
    query_lens: list[int]
    kv_lens: list[int]
    page_table: torch.Tensor  # [rows, max_pages] page ids (padding rows/cols are 0)
    # The same per-sequence numbers on the device, for kernels; sequence i's pages are row
    # `seq_table_rows[i]` of `page_table` (i itself, unless the table is persistent).
    seq_table_rows: torch.Tensor  # [B]
    seq_query_starts: torch.Tensor  # [B]
    seq_query_lens: torch.Tensor  # [B]
    seq_kv_lens: torch.Tensor  # [B]
    # Extend sequences: their indices (host and device) and the longest new-token run.
    prefill_seqs: list[int]
    prefill_index: torch.Tensor  # [P]
    max_prefill_query_len: int
    # Decode sequences: their token rows, rows of `page_table` and KV lengths.
    decode_token_rows: torch.Tensor  # [D]
    decode_table_rows: torch.Tensor  # [D]
    decode_kv_lens: torch.Tensor  # [D]
    max_decode_kv_len: int
    # Sequence index -> [query_len, width] bool: which of its last `width` keys each new token
    # may see (replaces the causal mask; every key before them is visible). Such sequences
    # run on the extend path.
    masks: dict[int, torch.Tensor] | None = None
    # The same masks flattened row-major into one tensor; `mask_offsets[i]` is where sequence
    # i's mask starts in it, -1 for a causal sequence, and `mask_widths[i]` its width. None
    # when no sequence has a mask.
    mask_data: torch.Tensor | None = None
    mask_offsets: torch.Tensor | None = None  # [B]
    mask_widths: torch.Tensor | None = None  # [B]
    # Sequences padded to this many rows each (a CUDA graph of several tokens per sequence;
    # padding rows are written, never read); 0: rows are packed.
    rows_per_seq: int = 0

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
        masks = masks or {}
        kv_lens = [c + q for c, q in zip(num_computed, query_lens, strict=True)]
        query_starts = list(itertools.accumulate(query_lens, initial=0))[:-1]
        # NOTE: whole-batch tensor ops, not one per sequence: at a few hundred sequences the
        # per-sequence form cost ~1 ms of host time a step.
        table = _page_table(pages)
        lens, starts = host_ints(query_lens), host_ints(query_starts)
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), lens)
        first_slot_less_row = host_ints(num_computed) - starts
        storage = torch.arange(seq_of_token.numel()) + first_slot_less_row[seq_of_token]
        slots = table[seq_of_token, storage // page_size] * page_size + storage % page_size
        if positions is not None:
            storage = host_ints(itertools.chain.from_iterable(positions))
        decode = [i for i, q in enumerate(query_lens) if q == 1 and i not in masks]
        prefill = [i for i, q in enumerate(query_lens) if q > 1 or i in masks]
        mask_offsets, mask_widths, offset = [-1] * num_seqs, [0] * num_seqs, 0
        for i in sorted(masks):
            mask_offsets[i], offset = offset, offset + masks[i].numel()
            mask_widths[i] = masks[i].shape[1]
        on_device = _pack(
            {
                "positions": storage,
                "slots": slots,
                "table": table,
                "table_rows": list(range(num_seqs)),
                "decode_table_rows": decode,
                "query_starts": starts,
                "query_lens": lens,
                "kv_lens": kv_lens,
                "prefill": prefill,
                "decode_rows": [query_starts[i] for i in decode],
                "decode_kv": [kv_lens[i] for i in decode],
                "mask_offsets": mask_offsets,
                "mask_widths": mask_widths,
            },
            device,
        )
        mask_data, device_masks = None, {}
        if masks:
            flat = torch.cat([masks[i].reshape(-1) for i in sorted(masks)])
            mask_data = flat.to(device, non_blocking=True)
            # The per-sequence masks are views of the one copy.
            device_masks = {
                i: mask_data[mask_offsets[i] : mask_offsets[i] + m.numel()].view(m.shape)
                for i, m in masks.items()
            }
        return cls(
            page_size=page_size,
            positions=on_device["positions"],
            slot_mapping=on_device["slots"],
            query_starts=query_starts,
            query_lens=list(query_lens),
            kv_lens=kv_lens,
            page_table=on_device["table"],
            seq_table_rows=on_device["table_rows"],
            seq_query_starts=on_device["query_starts"],
            seq_query_lens=on_device["query_lens"],
            seq_kv_lens=on_device["kv_lens"],
            prefill_seqs=prefill,
            prefill_index=on_device["prefill"],
            max_prefill_query_len=max((query_lens[i] for i in prefill), default=0),
            decode_token_rows=on_device["decode_rows"],
            decode_table_rows=on_device["decode_table_rows"],
            decode_kv_lens=on_device["decode_kv"],
            max_decode_kv_len=max((kv_lens[i] for i in decode), default=0),
            masks=device_masks or None,
            mask_data=mask_data,
            mask_offsets=on_device["mask_offsets"] if masks else None,
            mask_widths=on_device["mask_widths"] if masks else None,
        )


def _page_table(pages: list[list[int]]) -> torch.Tensor:
    """[sequences, longest page list] int64: each sequence's page ids, then 0s."""
    lens = host_ints(map(len, pages))
    width = max(int(lens.max()), 1) if len(pages) else 1
    table = torch.zeros(len(pages), width, dtype=torch.int64)
    table[torch.arange(width) < lens[:, None]] = host_ints(itertools.chain.from_iterable(pages))
    return table


def _pack(
    parts: dict[str, torch.Tensor | list[int]], device: torch.device
) -> dict[str, torch.Tensor]:
    """Copy int64 tensors and lists to `device` in one transfer; views keep their shapes.

    Every view starts 16 bytes aligned: Triton compiles a kernel per alignment of its pointer
    arguments, so views at odd offsets would compile new variants at serve time as the
    step's sizes change."""
    tensors = {
        name: (part if isinstance(part, torch.Tensor) else host_ints(part))
        for name, part in parts.items()
    }
    starts, size = {}, 0
    for name, t in tensors.items():
        starts[name] = size
        size += t.numel() + t.numel() % 2  # int64: two per 16 bytes
    flat = torch.zeros(size, dtype=torch.int64)
    for name, t in tensors.items():
        flat[starts[name] : starts[name] + t.numel()] = t.reshape(-1)
    flat = flat.to(device, non_blocking=True)
    return {
        name: flat[starts[name] : starts[name] + t.numel()].view(t.shape)
        for name, t in tensors.items()
    }
