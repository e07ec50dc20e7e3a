"""Decode from captured CUDA graphs against eager decode, on the GPU: the waves of requests
of tests/unit/engine/runtime/test_decode_graphs.py (every bucket, padded batches, batches too
large for a graph, a seeded request, preemption)."""

from __future__ import annotations

import pytest

from pdserve.engine.runtime.decode_graphs import DecodeGraphRunner, batch_buckets
from tests.unit.engine.runtime.test_decode_graphs import MAX_BS, run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("pages", [40, 9])
def test_graphs_replay_the_static_inputs_eager_tokens_bit_for_bit(
    pages, tiny_model_dirs, monkeypatch
):
    """bfloat16: the same kernels on the same padded inputs, replayed or launched one by
    one, give the same bits."""
    model = tiny_model_dirs("qwen3")
    tokens, engine, _, _ = run(model, graphs=True, pages=pages, device="cuda", dtype="bfloat16")
    graphs = engine.runner.decode_graphs
    assert set(graphs.replays) == set(batch_buckets(MAX_BS))
    assert not graphs.eager_runs
    monkeypatch.setattr(DecodeGraphRunner, "capture", lambda self, pool=None: None)
    eager, engine, _, _ = run(model, graphs=True, pages=pages, device="cuda", dtype="bfloat16")
    assert not engine.runner.decode_graphs.replays
    assert tokens == eager


def test_graphs_give_the_plain_paths_tokens_in_float32(tiny_model_dirs):
    model = tiny_model_dirs("llama")
    tokens, *_ = run(model, graphs=True, pages=40, device="cuda", dtype="float32")
    plain, engine, *_ = run(model, graphs=False, pages=40, device="cuda", dtype="float32")
    assert engine.runner.decode_graphs is None
    assert tokens == plain
