"""The plan of which prefill rank sends which KV heads to which decode rank
(`head_slices`), checked against the engine's own split for every pair of
TP sizes a model's KV heads allow."""

from __future__ import annotations

import itertools

import pytest

from pdserve.engine.parallel.tensor_parallel import ModelSplit
from pdserve.transfer.backends.dist.head_slices import (
    HeadSplitError,
    head_slices,
    kv_heads_of,
    link_parts,
    tp_mismatch,
)


def engine_heads(num_kv_heads: int, size: int, rank: int) -> range:
    split = ModelSplit(size, 8 * num_kv_heads, num_kv_heads, 16, 64, 128)
    start = split.kv_head_start(rank)
    return range(start, start + split.kv_heads_per_rank)


CASES = [
    (heads, p, d) for heads in (1, 2, 4, 8) for p, d in itertools.product((1, 2, 4, 8), repeat=2)
]


@pytest.mark.parametrize(("heads", "prefill_tp", "decode_tp"), CASES)
def test_every_decode_rank_gets_each_of_its_heads_once_from_a_holder(heads, prefill_tp, decode_tp):
    for tp in (prefill_tp, decode_tp):
        for rank in range(tp):
            assert kv_heads_of(heads, tp, rank) == engine_heads(heads, tp, rank)
    slices = head_slices(heads, prefill_tp, decode_tp)
    pairs = [(s.src, s.dst) for s in slices]
    assert pairs == sorted(set(pairs)), "at most one run per pair, in (src, dst) order"
    for dst in range(decode_tp):
        got = sorted(h for s in slices if s.dst == dst for h in range(s.first, s.first + s.count))
        assert got == list(kv_heads_of(heads, decode_tp, dst))
    for s in slices:
        held = kv_heads_of(heads, prefill_tp, s.src)
        assert held.start <= s.first and s.first + s.count <= held.stop
    assert (0, 0) in pairs  # the rank 0s always share head 0: the draft travels there


def test_replicated_heads_come_from_their_holders_in_turn():
    # 2 heads on 4 prefill ranks (each on two) to 4 decode ranks: every prefill rank sends.
    assert {s.src for s in head_slices(2, 4, 4)} == {0, 1, 2, 3}
    # 4 heads from TP 1 to TP 2: one prefill rank, two runs of two heads.
    assert [(s.dst, s.first, s.count) for s in head_slices(4, 1, 2)] == [(0, 0, 2), (1, 2, 2)]


def test_the_draft_travels_with_the_rank_0s_part_only():
    parts = link_parts(head_slices(4, 2, 2), has_draft=True)
    assert [(p.src, p.dst, p.draft) for p in parts] == [(0, 0, True), (1, 1, False)]
    assert parts[0].nbytes(10, 7, pages=3, draft_pages=2) == 10 * 2 * 3 + 7 * 2
    assert parts[1].nbytes(10, 7, pages=3, draft_pages=2) == 10 * 2 * 3


def test_a_size_that_does_not_split_the_heads_is_refused_with_the_reason():
    with pytest.raises(HeadSplitError, match="does not split the model's 4 KV heads"):
        head_slices(4, 3, 1)
    assert "decode's tensor-parallel size: TP size 3" in tp_mismatch(4, 3, "decode")
    assert tp_mismatch(4, 8, "decode") is None
