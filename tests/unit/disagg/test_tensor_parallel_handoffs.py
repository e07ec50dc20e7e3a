"""Prefill and decode workers at different tensor-parallel sizes (gloo between each worker's
rank processes on CPU), in one process over the transfer layer: the KV travels in the layout of
one rank with every KV head, gathered from every prefill rank and scattered to every decode
rank, so any pair of sizes gives colocated TP 1's tokens; KV heads replicated on ranks go once;
a speculative draft's KV and seed state (on rank 0 alone) travel beside the target's; a decode
rank that died fails the room, names the rank, and leaves no page held on either side."""

from __future__ import annotations

import signal
from collections import Counter

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.decode.connector import DecodeConnector
from pdserve.disagg import rank_worker
from pdserve.disagg.tensor_parallel_stager import TensorParallelStager
from pdserve.prefill.connector import PrefillConnector
from pdserve.protocol.spec_settings import SpecSettings
from pdserve.synthetic.tiny_model import make_tiny_model
from pdserve.transfer.backends.dist.head_slices import head_slices
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.kv_staging import StagingError
from tests.conftest import random_prompts
from tests.unit.disagg.test_handoffs import boot, drive, finished, generate, tokens

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
# Small pages and chunks: a prompt spans pages and chunks.
OPTIONS = {"device": "cpu", "page_size": 4, "chunked_prefill_size": 16}
PROMPT_LENGTHS = (1, 6, 17, 30)


def transfer_config(backend: str, piece_bytes: int | None = None) -> TransferConfig:
    """piece_bytes None: the default piece size (tiny prompts: one piece, after the prefill)."""
    sized = {} if piece_bytes is None else {"piece_bytes": piece_bytes}
    return TransferConfig(
        backend=backend,
        **sized,
        bootstrap_port=0,
        progress_timeout_s=20,
        peer_timeout_s=5,
        heartbeat_interval_s=0.2,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """KV heads -> a tiny qwen3 with that many (4: split one or two per rank; 2: replicated
    on neighbouring ranks at TP 4)."""
    cache = {}

    def get(kv_heads: int) -> str:
        if kv_heads not in cache:
            folder = tmp_path_factory.mktemp(f"kv{kv_heads}")
            cache[kv_heads] = str(make_tiny_model(folder, "qwen3", num_kv_heads=kv_heads))
        return cache[kv_heads]

    return get


def colocated_tokens(model: str, prompts) -> list[list[int]]:
    with LLM(model, **OPTIONS) as llm:
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def run_rooms(prefill, decode, prompts, deadline_s=90.0) -> dict:
    messages = {
        prefill: [generate(f"p{i}", p, GREEDY, boot(prefill, i)) for i, p in enumerate(prompts)],
        decode: [generate(f"d{i}", p, GREEDY, boot(prefill, i)) for i, p in enumerate(prompts)],
    }
    names = [f"d{i}" for i in range(len(prompts))] + [f"p{i}" for i in range(len(prompts))]
    return drive(
        prefill,
        decode,
        until=lambda o: all(finished(o, n) for n in names),
        messages=messages,
        deadline_s=deadline_s,
    )


def pair(model, prefill_tp, decode_tp, backend, piece_bytes=None, **options):
    """A prefill and a decode handoff over engines at these TP sizes (their other ranks with
    KV links of their own, as the worker factories start them)."""
    config = transfer_config(backend, piece_bytes)
    options = {"rank_worker_module": rank_worker.__name__, **options}
    prefill = PrefillConnector(LLM(model, tp_size=prefill_tp, **OPTIONS, **options).engine, config)
    decode = DecodeConnector(LLM(model, tp_size=decode_tp, **OPTIONS, **options).engine, config)
    return prefill, decode


def close(*handoffs) -> None:
    for handoff in handoffs:
        handoff.stop()
        handoff.engine.close()


@pytest.mark.parametrize(
    ("backend", "prefill_tp", "decode_tp", "kv_heads", "piece_bytes"),
    [
        # tcp: the KV goes through each worker's rank 0.
        ("tcp", 2, 1, 4, None),
        # TP 4 over 2 KV heads: each head on two prefill ranks, sent once.
        ("tcp", 4, 2, 2, None),
        # gloo: each rank sends or receives its own heads over links of its own.
        ("gloo", 2, 1, 4, None),
        ("gloo", 1, 2, 4, None),
        ("gloo", 2, 2, 4, None),
        # 2 KV heads: replicated on decode's 4 ranks, each from one of prefill's 2.
        ("gloo", 2, 4, 2, None),
        # A piece after every chunk: every rank gathers between prefill steps.
        ("gloo", 2, 1, 4, 1),
    ],
)
def test_pd_across_tp_sizes_equals_colocated_tp1(
    backend, prefill_tp, decode_tp, kv_heads, piece_bytes, models
):
    model = models(kv_heads)
    prompts = random_prompts(PROMPT_LENGTHS, 250, seed=5)
    expected = colocated_tokens(model, prompts)
    prefill, decode = pair(model, prefill_tp, decode_tp, backend, piece_bytes)
    try:
        # NOTE: the wire carries every KV head whatever the size: both sides agree on it.
        assert prefill.transfer.layout == decode.transfer.layout
        assert prefill.transfer.layout.num_kv_heads == kv_heads
        outputs = run_rooms(prefill, decode, prompts)
        for i, want in enumerate(expected):
            assert tokens(outputs, f"d{i}") == want, f"prompt {i}"
            assert outputs[f"d{i}"][-1].failure is None
        if piece_bytes:
            assert prefill.metrics.pieces_sent > len(prompts)  # the long prompts streamed
        if backend == "gloo":
            # Every pair of ranks in the plan moved KV over its own link, and no other did.
            plan = {(s.src, s.dst) for s in head_slices(kv_heads, prefill_tp, decode_tp)}
            sent = prefill.server.plane.bytes_by_link
            received = decode.client.plane.bytes_by_link
            assert set(sent) == plan and all(sent.values())
            assert {(src, dst) for dst, src in received} == plan
            assert sent == Counter({(src, dst): n for (dst, src), n in received.items()})
        assert prefill.engine.kv_pages_in_use == 0
        assert decode.engine.kv_pages_in_use == 0
    finally:
        close(prefill, decode)


@pytest.mark.parametrize(("size", "kv_heads"), [(2, 4), (4, 2)])
def test_scatter_then_gather_gives_back_every_head(size, kv_heads, models):
    """Random bytes written through the stager into pages of every rank (replicated heads
    too) come back unchanged, and only the pages named were written."""
    with LLM(models(kv_heads), tp_size=size, **OPTIONS) as llm:
        pool = llm.engine.kv_pool
        stager = TensorParallelStager(llm.engine.ranks, pool, [])
        assert pool.num_kv_heads == max(kv_heads // size, 1)
        assert stager.page_bytes[0] * pool.num_kv_heads == pool.nbytes // pool.num_pages * kv_heads
        pages = [9, 3, 14]
        total = stager.nbytes([pages])
        data = torch.randint(0, 256, (total,), dtype=torch.uint8)
        stager.scatter([pages], data)
        assert torch.equal(stager.gather([pages]), data)
        untouched = stager.gather([[0, 1, 2]])
        assert not untouched.any(), "pages not named stay as they were (zeros)"
        with pytest.raises(StagingError, match="outside"):
            stager.gather([[pool.num_pages]])
        # The ranks are still in step after the refusal: a forward pass works.
        llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, temperature=0))


@pytest.mark.parametrize(
    ("algorithm", "prefill_tp", "decode_tp", "backend"),
    [
        ("STANDALONE", 2, 1, "tcp"),
        ("EAGLE3", 1, 2, "tcp"),
        # The draft's KV rides with the rank 0s' part of each piece.
        ("STANDALONE", 2, 2, "gloo"),
    ],
)
def test_speculative_state_travels_across_tp_sizes(
    algorithm, prefill_tp, decode_tp, backend, spec_drafts, tiny_model_dirs
):
    """Drafts run on rank 0 alone: their KV travels after the target's heads (every head),
    EAGLE-3's hidden state in the metadata record, and decode at another TP size drafts from
    them: exactly the target's tokens."""
    model = tiny_model_dirs("llama")
    prompts = random_prompts(PROMPT_LENGTHS, 250, seed=7)
    expected = colocated_tokens(model, prompts)
    settings = SpecSettings(
        algorithm,
        draft_model_path=spec_drafts[algorithm],
        num_steps=3,
        eagle_topk=1,
        num_draft_tokens=4,
    )
    prefill, decode = pair(model, prefill_tp, decode_tp, backend, speculative=settings)
    try:
        assert len(prefill.transfer.stager.pools) == 2  # target and draft KV move
        outputs = run_rooms(prefill, decode, prompts)
        for i, want in enumerate(expected):
            assert tokens(outputs, f"d{i}") == want, f"prompt {i}"
        assert outputs["d0"][-1].spec_verify_ct > 0
        assert prefill.engine.kv_pages_in_use == 0
        assert decode.engine.kv_pages_in_use == 0
    finally:
        close(prefill, decode)


@pytest.mark.parametrize("backend", ["tcp", "gloo"])
def test_a_dead_decode_rank_fails_the_room_and_frees_both_sides(backend, models):
    model = models(4)
    prefill, decode = pair(model, 1, 2, backend)
    try:
        rank = decode.engine.ranks.processes[0]
        rank.send_signal(signal.SIGKILL)
        rank.wait(timeout=10)
        prompt = random_prompts((9,), 250, seed=3)[0]
        outputs = drive(
            prefill,
            decode,
            until=lambda o: finished(o, "d0") and finished(o, "p0"),
            messages={
                prefill: [generate("p0", prompt, GREEDY, boot(prefill, 0))],
                decode: [generate("d0", prompt, GREEDY, boot(prefill, 0))],
            },
            deadline_s=60,
        )
        failure = outputs["d0"][-1].failure
        assert failure is not None and "rank 1 exited" in failure.message
        assert decode.engine.kv_pages_in_use == 0
        assert prefill.engine.kv_pages_in_use == 0
    finally:
        close(prefill, decode)
