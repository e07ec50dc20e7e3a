"""The one forward path: `ModelRunner.forward` over a `ForwardBatch` computes plain decode
tokens, prefill chunks and tree verifications side by side, each as it would alone; a tree
row sees exactly its path; `is_decode` tells a plain decode batch; captures keep features."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM
from pdserve.engine.core.page_allocator import pages_needed
from pdserve.engine.runtime.forward_batch import Capture, ForwardBatch

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


PAGE = 4
# A tree after the root r: nodes 0 and 1 are r's children, node 2 is node 1's child.
TREE_TOKENS, TREE_DEPTHS = [11, 12, 14], [1, 1, 2]
TREE_MASK = [  # rows root, 0, 1, 2 over columns root, 0, 1, 2
    [True, False, False, False],
    [True, True, False, False],
    [True, False, True, False],
    [True, False, True, True],
]


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    return LLM(tiny_model_dirs("llama"), device="cpu", page_size=PAGE).engine


@pytest.fixture
def pages(engine):
    """Callable prompt -> pages holding its KV (room for 4 more tokens), freed afterwards."""
    held = []

    def prefill(prompt: list[int]) -> list[int]:
        held.append(engine.allocator.allocate(pages_needed(len(prompt) + 4, PAGE)))
        batch = ForwardBatch()
        batch.add(held[-1], 0, prompt)
        engine.runner.forward(batch)
        return held[-1]

    yield prefill
    for p in held:
        engine.allocator.free(p)


def tree_mask(num_cached: int) -> torch.Tensor:
    mask = torch.ones(4, num_cached + 4, dtype=torch.bool)
    mask[:, num_cached:] = torch.tensor(TREE_MASK)
    return mask


def add_verification(batch: ForwardBatch, pages: list[int], n: int, root: int) -> None:
    positions = [n, *(n + d for d in TREE_DEPTHS)]
    batch.add(pages, n, [root, *TREE_TOKENS], positions, tree_mask(n))


def test_a_tree_row_sees_exactly_its_path(engine, pages):
    prompt = [5, 9, 13, 2, 7]
    owned = pages(prompt[:-1])
    verify = ForwardBatch()
    add_verification(verify, owned, 4, prompt[-1])
    tree = engine.runner.forward(verify).hidden
    # Root -> node 1 -> node 2 as a plain chain: the same rows, causally.
    chain = ForwardBatch()
    chain.add(owned, 4, [prompt[-1], 12, 14])
    path = engine.runner.forward(chain).hidden
    assert torch.allclose(tree[[0, 2, 3]], path, atol=1e-5)
    assert not torch.allclose(tree[1], path[1], atol=1e-3)  # node 0 is 11, not 12


def test_one_pass_computes_every_kind_of_sequence_as_it_would_alone(engine, pages):
    decoding, verifying = pages([3, 4, 5, 6, 8, 1]), pages([7, 7, 2, 9])
    prefilling = engine.allocator.allocate(pages_needed(7, PAGE))
    sequences = [
        lambda b: b.add(decoding, 6, [21]),
        lambda b: add_verification(b, verifying, 4, 30),
        lambda b: b.add(prefilling, 0, [40, 41, 42, 43, 44, 45, 46]),
    ]
    try:
        mixed = ForwardBatch()
        for add in sequences:
            add(mixed)
        together = engine.runner.forward(mixed, Capture.layers([1, 0]))
        assert not mixed.is_decode and together.features.shape == (12, 2 * 64)
        for i, add in enumerate(sequences):
            alone = ForwardBatch()
            add(alone)
            hidden = engine.runner.forward(alone).hidden
            assert torch.allclose(together.hidden[together.rows(i)], hidden, atol=1e-5)
    finally:
        engine.allocator.free(prefilling)


def test_final_capture_keeps_the_hidden_states(engine, pages):
    batch = ForwardBatch()
    batch.add(pages([1, 2, 3]), 3, [4])
    output = engine.runner.forward(batch, Capture.final())
    assert output.features is output.hidden
    assert engine.runner.forward(batch).features is None


def test_is_decode_means_one_causal_token_each_at_its_next_position():
    batch = ForwardBatch()
    assert not batch.is_decode  # nothing to run
    batch.add([0], 3, [5])
    batch.add([1], 0, [6])
    assert batch.is_decode and batch.explicit_positions() is None
    chunk = ForwardBatch()
    chunk.add([0], 3, [5])
    chunk.add([1], 0, [6, 7])
    assert not chunk.is_decode
    placed = ForwardBatch()
    placed.add([0], 3, [5], positions=[3])
    placed.add([1], 2, [6])
    assert not placed.is_decode
    assert placed.explicit_positions() == [[3], [2]]  # the others' positions are their slots
    masked = ForwardBatch()
    masked.add([0], 3, [5], mask=torch.ones(1, 4, dtype=torch.bool))
    assert not masked.is_decode and list(masked.masks) == [0]


def test_a_batch_refuses_inputs_that_cannot_describe_a_sequence():
    batch = ForwardBatch()
    with pytest.raises(ValueError, match="at least one token"):
        batch.add([0], 0, [])
    with pytest.raises(ValueError, match="2 positions for 1 tokens"):
        batch.add([0], 0, [5], positions=[0, 1])
    for shape in [(1, 5), (2, 4)]:  # wider than the sequence's keys; a row per new token
        with pytest.raises(ValueError, match=r"expected \(1, width\) with 1 <= width <= 4"):
            batch.add([0], 3, [5], mask=torch.ones(*shape, dtype=torch.bool))
    assert len(batch) == 0
    batch.add([0], 3, [5], mask=torch.ones(1, 1, dtype=torch.bool))  # its own key only
    assert len(batch) == 1


def test_capture_kinds():
    assert Capture.NONE.kind == "none" and Capture.final().kind == "final"
    assert Capture.layers([2, 0]).layer_ids == (2, 0)
    with pytest.raises(ValueError, match="at least one layer"):
        Capture.layers([])
    with pytest.raises(ValueError, match="capture kind"):
        Capture("hidden")


def test_a_pass_splits_by_tokens_with_the_straddling_sequence_in_both_parts():
    batch = ForwardBatch()
    batch.add([1], 3, [7])  # a decode token
    batch.add([2, 3], 0, [10, 11, 12, 13, 14])  # a prefill chunk
    batch.add([4], 5, [8])
    first, second = batch.split_tokens(3)
    assert (first.pages, first.num_computed, first.token_ids) == (
        [[1], [2, 3]],
        [3, 0],
        [[7], [10, 11]],
    )
    assert (second.pages, second.num_computed, second.token_ids) == (
        [[2, 3], [4]],
        [2, 5],
        [[12, 13, 14], [8]],
    )
    # A split on a sequence boundary leaves every sequence whole.
    first, second = batch.split_tokens(6)
    assert (first.token_ids, second.token_ids) == ([[7], [10, 11, 12, 13, 14]], [[8]])
    for at in (0, 7):
        with pytest.raises(ValueError, match="split at token"):
            batch.split_tokens(at)
    masked = ForwardBatch()
    masked.add([1], 0, [1, 2], mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="only a causal pass"):
        masked.split_tokens(1)
