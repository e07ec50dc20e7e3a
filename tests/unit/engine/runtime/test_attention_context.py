"""A step's attention metadata (`AttentionContext.build`), worked out by hand for a small
mixed batch, and the host int conversion it is built with."""

from __future__ import annotations

import torch

from pdserve.engine.runtime.attention import AttentionContext
from pdserve.engine.runtime.host_ints import host_ints


def test_a_mixed_batch_gets_its_slots_positions_and_page_table():
    ctx = AttentionContext.build(
        page_size=4,
        # seq 0: 3 cached tokens, 2 new (positions 3, 4: page 5 slot 3, page 2 slot 0);
        # seq 1: its first token (page 7 slot 0), decoded.
        pages=[[5, 2], [7]],
        num_computed=[3, 0],
        query_lens=[2, 1],
        device=torch.device("cpu"),
    )
    assert ctx.positions.tolist() == [3, 4, 0]
    assert ctx.slot_mapping.tolist() == [5 * 4 + 3, 2 * 4 + 0, 7 * 4 + 0]
    assert ctx.page_table.tolist() == [[5, 2], [7, 0]]
    assert ctx.query_starts == [0, 2] and ctx.kv_lens == [5, 1]
    assert ctx.prefill_seqs == [0] and ctx.decode_token_rows.tolist() == [2]
    assert ctx.decode_kv_lens.tolist() == [1] and ctx.seq_query_lens.tolist() == [2, 1]


def test_explicit_positions_move_positions_not_slots():
    ctx = AttentionContext.build(
        page_size=4,
        pages=[[9, 1]],
        num_computed=[2],
        query_lens=[3],
        device=torch.device("cpu"),
        positions=[[2, 3, 3]],  # a tree's two nodes at depth 1
    )
    assert ctx.positions.tolist() == [2, 3, 3]
    assert ctx.slot_mapping.tolist() == [9 * 4 + 2, 9 * 4 + 3, 1 * 4 + 0]


def test_host_ints_equal_torch_tensor_of_the_list():
    for values in ([], [0], [-1, 2**62, 7], list(range(1000))):
        got = host_ints(values)
        assert got.dtype == torch.int64
        assert torch.equal(got, torch.tensor(values, dtype=torch.int64))
    assert host_ints(iter([3, 4])).tolist() == [3, 4]
