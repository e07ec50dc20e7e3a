"""A GPU prefill worker streams KV while it computes (one GPU, both handoffs in one process):
the pieces are gathered on the compute stream, copied to pinned host memory without blocking
and sent once their event completed (tcp, and gloo from host memory), and decode's answer
equals colocated serving on the same GPU. Skipped without a GPU; run on the device machine."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve import LLM
from pdserve.decode.connector import DecodeConnector
from pdserve.engine.core.request import RequestStatus
from pdserve.prefill.connector import PrefillConnector
from tests.conftest import random_prompts
from tests.unit.disagg.test_handoffs import (
    CONFIG,
    GREEDY,
    boot,
    drive,
    finished,
    generate,
    phase,
    tokens,
)

pytestmark = pytest.mark.gpu

KV_BYTES = 128 << 20


@pytest.mark.parametrize("backend", ["tcp", "gloo"])
def test_streamed_handoff_on_a_gpu_equals_colocated(backend, tiny_model_dirs):
    model = tiny_model_dirs("llama")
    engine_args = dict(device="cuda", dtype="float32", kv_cache_memory=KV_BYTES)
    prompts = random_prompts((300, 90, 7), 1000, seed=3)
    expected = [o.token_ids for o in LLM(model, **engine_args).generate(prompts, GREEDY)]
    config = dataclasses.replace(CONFIG, backend=backend, piece_bytes=1, progress_timeout_s=20)
    prefill = PrefillConnector(LLM(model, chunked_prefill_size=32, **engine_args).engine, config)
    decode = DecodeConnector(LLM(model, **engine_args).engine, config)
    try:
        messages = {
            prefill: [
                generate(f"p{i}", p, GREEDY, boot(prefill, i)) for i, p in enumerate(prompts)
            ],
            decode: [generate(f"d{i}", p, GREEDY, boot(prefill, i)) for i, p in enumerate(prompts)],
        }
        names = [f"d{i}" for i in range(len(prompts))]
        outputs = drive(
            prefill, decode, until=lambda o: all(finished(o, n) for n in names), messages=messages
        )
        for i, want in enumerate(expected):
            assert tokens(outputs, f"d{i}") == want, f"prompt {i}"
        assert prefill.metrics.pieces_sent > len(prompts)  # the long prompts streamed
        drive(prefill, until=lambda _: not phase(prefill, RequestStatus.SENDING_KV), deadline_s=20)
        assert prefill.engine.kv_pages_in_use == 0 and decode.engine.kv_pages_in_use == 0
    finally:
        prefill.stop()
        decode.stop()


def test_gather_and_scatter_queue_behind_the_gpu_without_waiting_for_it():
    """A piece's gather (prefill, right behind the chunk that wrote the pages) and a commit's
    scatter (decode, behind its running steps) must not stop the host until the GPU catches
    up: a blocking page-index copy would, and the engine loop could not queue its next step
    meanwhile. Both are called while the GPU sleeps; each returns before the sleep ends, and
    the bytes are right once it has. (Each runs once first: a kernel's first launch in a
    process loads its module, which may wait for the GPU: once per process, not per call.)"""
    import torch

    from pdserve.engine.runtime.kv_pool import KVPool
    from pdserve.transfer.kv_staging import KVStager

    shape = dict(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, device=torch.device("cuda"))
    pool = KVPool(num_pages=8, dtype=torch.float32, **shape)
    pool.storage.copy_(torch.randn_like(pool.storage))
    stager = KVStager([pool])
    stager.scatter([[1]], stager.gather([[5]]))
    torch.cuda.synchronize()
    other = torch.randn_like(pool.storage)
    incoming = other[:, :, 3:4].contiguous().view(torch.uint8).flatten()
    for step in ("gather", "scatter"):
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time
        asleep = torch.cuda.Event()
        asleep.record()
        if step == "gather":
            data = stager.gather([[5, 2]])
        else:
            stager.scatter([[1]], incoming)
        assert not asleep.query(), f"{step} waited for the GPU"
        torch.cuda.synchronize()
    gathered = data.view(torch.float32).view(2, 2, 2, 4, 2, 8)
    torch.testing.assert_close(gathered[:, :, 0], pool.storage[:, :, 5])
    torch.testing.assert_close(pool.storage[:, :, 1], other[:, :, 3])
