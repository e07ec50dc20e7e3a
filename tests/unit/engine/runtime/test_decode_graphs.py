"""Decode over the graph runner's static inputs against the plain forward path.

Without CUDA nothing is captured: the runner runs its padded static inputs eagerly (under the
Triton interpreter), which is everything a graph replays except the capture itself. On a GPU
the same waves replay graphs; tests/gpu/test_decode_graphs_gpu.py also compares replayed and
eager bits.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.checkpoint.model_config import ModelConfig
from pdserve.engine.core.config import EngineConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.runtime.decode_graphs import batch_buckets
from pdserve.engine.runtime.kv_pool import KVPool
from tests.conftest import random_prompts

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE_SIZE = 4
MAX_BS = 4
# (prompt length, new tokens): finishing at different steps, so the decode batch shrinks
# through every bucket and through padded sizes.
SHAPES = [(3, 2), (9, 12), (4, 7), (1, 1), (14, 9), (6, 5), (2, 11), (5, 3), (8, 6), (7, 14)]


def test_buckets_are_powers_of_two_then_steps_of_eight():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert batch_buckets(42) == [1, 2, 4, 8, 16, 24, 32, 40, 42]


def run(model_dir: str, *, graphs: bool, pages: int, device=DEVICE, dtype="float32", overlap=False):
    """Requests arriving in three waves, one of them seeded, over `pages` KV pages (few
    pages: requests are preempted and recomputed). -> tokens per request, the engine, every
    step's new-token counts and the number of preemptions. `overlap`: overlap scheduling
    on (a GPU engine has it on by default; here it is set either way)."""
    page_bytes = KVPool.bytes_per_page(
        **_pool_shape(model_dir), page_size=PAGE_SIZE, dtype=getattr(torch, dtype)
    )
    engine = Engine(
        EngineConfig(
            model_path=model_dir,
            device=device,
            dtype=dtype,
            attention_backend="triton",
            page_size=PAGE_SIZE,
            kv_cache_memory=pages * page_bytes,
            max_model_len=32,
            cuda_graph_max_bs=MAX_BS,
            disable_cuda_graph=not graphs,
        )
    )
    engine.overlap = overlap
    prompts = random_prompts([n for n, _ in SHAPES], engine.model_config.vocab_size, seed=5)
    waves = [range(0, 3), range(3, 9), range(9, 10)]
    outputs, steps, requests = {}, [], []
    for wave in waves:
        for i in wave:
            sampled = {"temperature": 0.8, "seed": 11} if i == 4 else {"temperature": 0}
            params = SamplingParams(max_new_tokens=SHAPES[i][1], ignore_eos=True, **sampled)
            requests.append(engine.add_request(str(i), prompts[i], params))
        for _ in range(2):
            outputs.update(_step(engine, steps))
    while engine.has_unfinished():
        outputs.update(_step(engine, steps))
    tokens = [outputs[str(i)] for i in range(len(SHAPES))]
    return tokens, engine, steps, sum(r.num_preemptions for r in requests)


def _step(engine: Engine, steps: list) -> dict[str, list[int]]:
    finished = {o.request_id: list(o.token_ids) for o in engine.step() if o.finished}
    steps.append(list(engine.current_batch.num_new_tokens))
    return finished


def _pool_shape(model_dir: str) -> dict:
    config = ModelConfig.from_pretrained(model_dir)
    return {
        "num_layers": config.num_layers,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
    }


@pytest.fixture(scope="module")
def runs(tiny_model_dirs):
    model = tiny_model_dirs("llama")
    return {graphs: run(model, graphs=graphs, pages=40) for graphs in (True, False)}


def test_static_padded_decode_gives_the_plain_paths_tokens(runs):
    with_graphs, *_ = runs[True]
    plain, engine, *_ = runs[False]
    assert with_graphs == plain
    assert [len(t) for t in plain] == [n for _, n in SHAPES]
    assert engine.runner.decode_graphs is None


def test_every_bucket_and_a_padded_size_ran_and_pages_came_back(runs):
    _, engine, steps, preemptions = runs[True]
    graphs = engine.runner.decode_graphs
    sizes = {len(s) for s in steps if all(n == 1 for n in s)}
    assert 3 in sizes, "the waves no longer make a padded decode batch"
    assert set(graphs.eager_runs + graphs.replays) == set(batch_buckets(MAX_BS))
    assert preemptions == 0
    assert engine.kv_pages_in_use == 0


def test_only_decode_batches_that_fit_run_on_static_inputs(runs):
    _, engine, steps, _ = runs[True]
    graphs = engine.runner.decode_graphs
    decode_steps = [s for s in steps if s and all(n == 1 for n in s) and len(s) <= MAX_BS]
    assert any(len(s) > MAX_BS for s in steps), "no decode batch was larger than max_bs"
    assert any(n > 1 for s in steps for n in s), "no prefill step ran"
    assert (graphs.eager_runs + graphs.replays).total() == len(decode_steps)
    if DEVICE == "cpu":
        assert not graphs.replays, "nothing is captured without CUDA"
    else:
        assert not graphs.eager_runs, "a captured bucket ran eagerly"


def test_preemption_recomputes_and_stays_exact(tiny_model_dirs, runs):
    """Few pages: requests are preempted and recomputed; the page table follows them."""
    plain, *_ = runs[False]
    tokens, engine, _, preemptions = run(tiny_model_dirs("llama"), graphs=True, pages=9)
    assert preemptions > 0
    assert tokens == plain
    assert engine.kv_pages_in_use == 0
