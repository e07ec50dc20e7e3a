"""Tensor parallelism on CPU (gloo between rank processes): TP 2 and TP 4 give TP 1's tokens for
every architecture, with KV heads split and replicated, with overlap scheduling and with every
speculative algorithm; the split's arithmetic and its refusals; a rank that dies fails the
step and frees every page; ranks leave when rank 0 dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.parallel.tensor_parallel import ModelSplit, TensorParallelError
from pdserve.engine.ranks.rank_group import RankDiedError
from pdserve.engine.runtime.forward_batch import Capture, ForwardBatch
from pdserve.protocol.spec_settings import SpecSettings
from pdserve.synthetic.tiny_model import make_tiny_model
from tests.conftest import ARCHS, random_prompts
from tests.waiting import wait_until

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


GREEDY = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
LENGTHS = (1, 6, 23, 41)
# Small pages and chunks: prompts span pages and chunks mix with decode steps.
OPTIONS = {"device": "cpu", "page_size": 4, "chunked_prefill_size": 16}


def split(size, heads=8, kv=4, intermediate=128, vocab=1000, head_dim=16):
    return ModelSplit(size, heads, kv, head_dim, intermediate, vocab)


# ---- the split -------------------------------------------------------------------------


def test_heads_mlp_and_vocabulary_divide_among_ranks():
    s = split(4, heads=8, kv=4, vocab=1001)
    assert (s.heads_per_rank, s.kv_heads_per_rank, s.intermediate_per_rank) == (2, 1, 32)
    assert [s.vocab_rows(r) for r in range(4)] == [(0, 251), (251, 251), (502, 251), (753, 248)]
    assert s.checkpoint_slice("model.layers.0.self_attn.qkv_proj.weight", 0, 3) == (0, 96, 32)
    assert s.checkpoint_slice("model.layers.0.self_attn.qkv_proj.weight", 2, 3) == (0, 48, 16)
    assert s.checkpoint_slice("model.layers.0.self_attn.o_proj.weight", None, 1) == (1, 32, 32)
    assert s.checkpoint_slice("model.layers.0.mlp.down_proj.weight", None, 2) == (1, 64, 32)
    assert s.checkpoint_slice("model.layers.0.input_layernorm.weight", None, 2) is None


def test_fewer_kv_heads_than_ranks_replicates_each_head_on_neighbouring_ranks():
    s = split(4, heads=8, kv=2)
    assert s.kv_heads_per_rank == 1
    assert [s.kv_head_start(r) for r in range(4)] == [0, 0, 1, 1]
    # NOTE: rank r's query heads 2r, 2r+1 read KV head (2r) // 4: the head it holds.
    group = s.num_heads // s.num_kv_heads
    for rank in range(4):
        first_query_head = rank * s.heads_per_rank
        assert first_query_head // group == s.kv_head_start(rank)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"size": 3, "heads": 8}, "does not divide the model's 8 attention heads"),
        ({"size": 4, "heads": 12, "kv": 6}, "6 KV heads: one must divide the other"),
        ({"size": 2, "intermediate": 129}, "intermediate_size 129"),
        ({"size": 0}, "--tp-size must be >= 1"),
    ],
)
def test_a_split_that_cannot_work_names_the_dimension(fields, message):
    with pytest.raises(TensorParallelError, match=message):
        split(**fields)


def test_an_engine_refuses_a_size_before_starting_any_rank(tiny_model_dirs):
    with pytest.raises(TensorParallelError, match="does not divide the model's 4 attention"):
        LLM(tiny_model_dirs("llama"), tp_size=3, **OPTIONS)


# ---- exactness ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kv4_models(tmp_path_factory):
    """arch -> a tiny model with 4 KV heads (so TP 4 splits them one per rank)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = str(make_tiny_model(tmp_path_factory.mktemp(arch), arch, num_kv_heads=4))
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, 500, seed=11)


@pytest.fixture(scope="module")
def tp1_tokens(kv4_models, prompts):
    cache = {}

    def get(arch):
        if arch not in cache:
            with LLM(kv4_models(arch), **OPTIONS) as llm:
                cache[arch] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        return cache[arch]

    return get


def generate(model_dir, prompts, size, *, overlap=False, **options):
    with LLM(model_dir, tp_size=size, **OPTIONS, **options) as llm:
        llm.engine.overlap = overlap
        outputs = llm.generate(prompts, GREEDY)
        assert llm.engine.kv_pages_in_use == 0
        return [o.token_ids for o in outputs]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_tp_output_equals_tp1_token_for_token(arch, size, kv4_models, tp1_tokens, prompts):
    assert generate(kv4_models(arch), prompts, size) == tp1_tokens(arch)


def test_replicated_kv_heads_equal_tp1(tiny_model_dirs, prompts):
    model = tiny_model_dirs("llama")  # 2 KV heads over 4 ranks
    with LLM(model, **OPTIONS) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert generate(model, prompts, 4) == expected


def test_overlapped_steps_broadcast_their_device_tokens(kv4_models, tp1_tokens, prompts):
    assert generate(kv4_models("llama"), prompts, 2, overlap=True) == tp1_tokens("llama")


# Every pass of at least 4 tokens (prefill chunks, alone or beside decode tokens) as two.
TWO_BATCHES = {"enable_two_batch_overlap": True, "two_batch_min_tokens": 4}


def count_two_batch_passes(llm) -> list[int]:
    """A counter of rank 0's passes run as two halves (so a test sees the path taken)."""
    runner, count = llm.engine.runner, [0]
    two = runner._forward_two_batches

    def counted(*args, **kwargs):
        count[0] += 1
        return two(*args, **kwargs)

    runner._forward_two_batches = counted
    return count


def test_two_batch_overlap_equals_tp1(kv4_models, tp1_tokens, prompts):
    """Prefill passes split in two halves of their tokens (a prompt straddling the split
    reads in its second half the KV its first half wrote), each half's all-reduces started
    while the other half computes: TP 1's tokens, with overlap scheduling too (Qwen3: its
    per-head q/k norms run in each half's attention)."""
    arch = "qwen3"
    with LLM(kv4_models(arch), tp_size=2, **OPTIONS, **TWO_BATCHES) as llm:
        llm.engine.overlap = True
        passes = count_two_batch_passes(llm)
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.engine.kv_pages_in_use == 0
    assert passes[0] >= 3
    assert got == tp1_tokens(arch)


CHAIN = {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
TREE = {"num_steps": 3, "eagle_topk": 3, "num_draft_tokens": 8}


@pytest.mark.parametrize(
    ("algorithm", "shape"),
    [("EAGLE", CHAIN), ("EAGLE3", TREE), ("STANDALONE", CHAIN), ("NGRAM", TREE)],
)
def test_speculative_decoding_under_tp_is_lossless(
    algorithm, shape, spec_drafts, tiny_model_dirs, prompts
):
    """The draft runs whole on rank 0; verification, and the KV moves of accepted tree
    nodes, run on every rank."""
    model = tiny_model_dirs("llama")
    repetitive = [*prompts, [11, 12, 13, 14] * 6]
    with LLM(model, **OPTIONS) as llm:
        expected = [o.token_ids for o in llm.generate(repetitive, GREEDY)]
    settings = SpecSettings(algorithm, draft_model_path=spec_drafts[algorithm], **shape)
    assert generate(model, repetitive, 2, speculative=settings) == expected


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_pass_run_as_two_computes_what_one_pass_does(backend, tiny_model_dirs):
    """Hidden states and captured layer outputs (what EAGLE drafts read) of one mixed pass,
    TP 2 with and without the split: the same rows, in the same order. On Triton the fused
    norms update each half's residual in place (the GPU's path; here, the interpreter)."""
    capture = Capture.layers([0, 1])
    results = []
    for options in ({}, TWO_BATCHES):
        options = {**options, "attention_backend": backend}
        with LLM(tiny_model_dirs("llama"), tp_size=2, **OPTIONS, **options) as llm:
            engine = llm.engine
            passes = count_two_batch_passes(llm)
            pages = engine.allocator.allocate(9)
            batch = ForwardBatch()
            batch.add(pages[:4], 0, list(range(3, 16)))  # 13 prompt tokens: straddles
            batch.add(pages[4:8], 0, list(range(20, 27)))
            batch.add(pages[8:], 0, [42])  # one token: attention's decode path
            out = engine.runner.forward(batch, capture)
            results.append((out.hidden.clone(), out.features.clone(), out.query_starts))
            engine.allocator.free(pages)
            assert passes[0] == (1 if options.get("enable_two_batch_overlap") else 0)
    (hidden, features, starts), (hidden2, features2, starts2) = results
    assert starts == starts2 == [0, 13, 20]
    torch.testing.assert_close(hidden2, hidden)
    torch.testing.assert_close(features2, features)


# ---- failures ----------------------------------------------------------------------------


def test_a_dead_rank_fails_the_step_and_every_page_is_freed(tiny_model_dirs, prompts):
    with LLM(tiny_model_dirs("llama"), tp_size=2, **OPTIONS) as llm:
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, GREEDY)
        engine.step()
        follower = engine.ranks.processes[0]
        follower.send_signal(signal.SIGKILL)
        follower.wait(timeout=10)
        started = time.monotonic()
        with pytest.raises(RankDiedError, match="rank 1 exited with code -9"):
            engine.step()
        assert time.monotonic() - started < 5
        failed = engine.fail_step("rank 1 died")
        assert {o.request_id for o in failed} == {f"r{i}" for i in range(len(prompts))}
        assert all(o.finished and o.failure is not None for o in failed)
        assert engine.kv_pages_in_use == 0  # NOTE: only the prefix cache's pages stay
        engine.add_request("late", prompts[0], GREEDY)
        with pytest.raises(RankDiedError):
            engine.step()


RANK0_THEN_EXIT = """
import os, sys
from pdserve import LLM
llm = LLM(sys.argv[1], tp_size=2, device="cpu")
print(llm.engine.ranks.processes[0].pid, flush=True)
os._exit(0)  # NOTE: no close(), no finalizer: as if killed
"""


def test_ranks_leave_when_rank0_is_gone(tiny_model_dirs):
    child = subprocess.run(
        [sys.executable, "-c", RANK0_THEN_EXIT, tiny_model_dirs("llama")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    pid = int(child.stdout.split()[-1])

    def gone():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # NOTE: a zombie has exited too (its parent is gone; init reaps it).
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1].startswith("Z")

    wait_until(gone, "rank 1 to leave after rank 0 exited", deadline_s=20)


def test_rank0_failing_inside_a_pass_stops_every_rank_instead_of_desynchronizing(
    tiny_model_dirs, prompts, monkeypatch
):
    """The other ranks may wait in a collective rank 0 never joins: the group is stopped and
    every later step fails, rather than a later pass pairing with the stale collective."""
    with LLM(tiny_model_dirs("llama"), tp_size=2, **OPTIONS) as llm:
        engine = llm.engine
        engine.add_request("r", prompts[2], GREEDY)

        def broken(*args, **kwargs):
            raise RuntimeError("a kernel failed")

        monkeypatch.setattr(engine.model, "forward", broken)
        with pytest.raises(RankDiedError, match="rank 0's forward pass failed: a kernel failed"):
            engine.step()
        engine.fail_step("stopped")
        assert engine.kv_pages_in_use == 0
        assert all(p.poll() is not None for p in engine.ranks.processes)
        monkeypatch.undo()
        engine.add_request("next", prompts[0], GREEDY)
        with pytest.raises(RankDiedError, match="were stopped"):
            engine.step()


def test_preempted_requests_are_mirrored_again_from_their_first_page(tiny_model_dirs):
    """Few KV pages: requests are preempted (their pages freed, the other ranks told they
    stopped) and recomputed later into other pages; tokens still equal TP 1's."""
    model = tiny_model_dirs("llama")
    prompts = random_prompts([1, 6, 23, 30], 500, seed=8)
    options = {**OPTIONS, "max_model_len": 48, "disable_prefix_caching": True}
    with LLM(model, **options) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    # NOTE: 1 KV head per rank: a page is 1 KiB (2 layers x K,V x 4 slots x 16 x fp32).
    with LLM(model, tp_size=2, kv_cache_memory=12 << 10, **options) as llm:
        engine = llm.engine
        assert engine.kv_pool.num_pages == 12
        requests = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step()
        assert sum(r.num_preemptions for r in requests) > 0
        assert [r.output_token_ids for r in requests] == expected
        assert engine.kv_pages_in_use == 0


def test_cached_prefix_pages_serve_every_rank(tiny_model_dirs):
    """A second wave reads the first wave's cached prompt pages: page ids are the same on
    every rank, so each rank's share of them is there."""
    model = tiny_model_dirs("llama")
    shared = random_prompts([24], 500, seed=9)[0]
    waves = [[[*shared, 7]], [[*shared, 8, 9], [*shared, 10]]]
    with LLM(model, **OPTIONS) as llm:
        expected = [[o.token_ids for o in llm.generate(wave, GREEDY)] for wave in waves]
    with LLM(model, tp_size=2, **OPTIONS) as llm:
        outputs = [llm.generate(wave, GREEDY) for wave in waves]
    assert [[o.token_ids for o in wave] for wave in outputs] == expected
    assert all(o.num_cached_tokens >= 20 for o in outputs[1])  # NOTE: 5 full pages of 4


def _rank_children() -> list[int]:
    """Rank processes this process started that still run."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue  # NOTE: it exited while being read
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"rank_worker" in cmdline:
            found.append(int(stat.parent.name))
    return found


def test_a_start_that_fails_after_the_ranks_started_leaves_none_running(tiny_model_dirs):
    from pdserve.engine.runtime.loader import KVCacheTooSmallError

    with pytest.raises(KVCacheTooSmallError, match="less than one sequence"):
        LLM(tiny_model_dirs("llama"), tp_size=2, kv_cache_memory=4096, **OPTIONS)
    assert _rank_children() == []


def test_a_worker_stuck_after_a_rank_died_is_told_within_the_grace(tiny_model_dirs):
    """Rank 0's thread blocked on the dead rank (here: it never steps again) never runs
    `check_alive`; the watching thread reports it after the grace, naming the rank."""
    with LLM(tiny_model_dirs("llama"), tp_size=2, **OPTIONS) as llm:
        ranks = llm.engine.ranks
        stuck = []
        ranks.watch(stuck.append, grace_s=0.5)
        follower = ranks.processes[0]
        follower.send_signal(signal.SIGKILL)
        follower.wait(timeout=10)
        wait_until(lambda: stuck, "the watcher to report the stuck worker", deadline_s=10)
        assert stuck == [
            "tensor-parallel rank 1 exited with code -9 and rank 0 did not get past it within 0.5 s"
        ]


def test_a_worker_that_closes_after_a_rank_died_is_not_reported(tiny_model_dirs):
    with LLM(tiny_model_dirs("llama"), tp_size=2, **OPTIONS) as llm:
        ranks = llm.engine.ranks
        stuck = []
        watcher = ranks.watch(stuck.append, grace_s=30.0)
        ranks.processes[0].send_signal(signal.SIGKILL)
        llm.engine.add_request("r", [5, 6, 7], GREEDY)
        with pytest.raises(RankDiedError):
            llm.engine.step()
        llm.close()  # NOTE: what the engine process does once its loop gives up
        watcher.join(timeout=10)  # NOTE: it ends at the close, not after the grace
        assert not watcher.is_alive() and stuck == []
