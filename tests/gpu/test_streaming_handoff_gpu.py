"""A GPU prefill worker streams KV while it computes (one GPU, both handoffs in one process):
the pieces are gathered on the compute stream, copied to pinned host memory without blocking
and sent once their event completed (tcp, and gloo from host memory), and decode's answer
equals colocated serving on the same GPU. Skipped without a GPU; run on the device machine."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve import LLM
from pdserve.decode.handoff import DecodeHandoff
from pdserve.prefill.handoff import PrefillHandoff
from tests.conftest import random_prompts
from tests.unit.test_handoffs import CONFIG, GREEDY, boot, drive, finished, generate, tokens

pytestmark = pytest.mark.gpu

KV_BYTES = 128 << 20


@pytest.mark.parametrize("backend", ["tcp", "gloo"])
def test_streamed_handoff_on_a_gpu_equals_colocated(backend, tiny_model_dirs):
    model = tiny_model_dirs("llama")
    engine_args = dict(device="cuda", dtype="float32", kv_cache_memory=KV_BYTES)
    prompts = random_prompts((300, 90, 7), 1000, seed=3)
    expected = [o.token_ids for o in LLM(model, **engine_args).generate(prompts, GREEDY)]
    config = dataclasses.replace(CONFIG, backend=backend, piece_bytes=1, progress_timeout_s=20)
    prefill = PrefillHandoff(LLM(model, chunked_prefill_size=32, **engine_args).engine, config)
    decode = DecodeHandoff(LLM(model, **engine_args).engine, config)
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
        drive(prefill, until=lambda _: not prefill.sending, deadline_s=20)
        assert prefill.engine.kv_pages_in_use == 0 and decode.engine.kv_pages_in_use == 0
    finally:
        prefill.stop()
        decode.stop()
