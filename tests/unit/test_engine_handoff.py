"""A prefill engine hands a request's KV and first token to a decode engine, in one process:
the decode engine continues exactly as a colocated engine would (greedy)."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.errors import InvalidRequestError
from pdserve.protocol.metadata_spec import MetadataSpec
from pdserve.protocol.transfer_messages import KVLayout, SpecLayout
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.decode_side import DecodeTransferClient
from pdserve.transfer.kv_staging import KVStager
from pdserve.transfer.metadata import MetadataRecord
from pdserve.transfer.prefill_side import PrefillTransferServer
from pdserve.transfer.room_state import TransferState
from tests.conftest import random_prompts
from tests.waiting import wait_until

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


def run_to_end(engine) -> dict:
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    return outputs


def prefill(engine, request_id, prompt, params=GREEDY):
    """Prefill only: one token, pages kept for the transfer."""
    params = dataclasses.replace(params, max_new_tokens=1)
    engine.add_request(request_id, prompt, params, hold_pages=True)
    first = run_to_end(engine)[request_id]
    return first[0], engine.held[request_id].pages


@pytest.fixture(scope="module")
def engines(tiny_model_dirs):
    model = tiny_model_dirs("qwen3")
    return (
        LLM(model, device="cpu", page_size=4).engine,
        LLM(model, device="cpu", page_size=4).engine,
        model,
    )


SEEDED = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_handoff_by_gather_and_scatter_equals_colocated(engines, params):
    """Seeded: the decode engine's draws continue where the prefill engine's left off (the
    first draw there is for the second output token), as in one colocated engine."""
    engine_p, engine_d, model = engines
    prompts = random_prompts((1, 5, 37), 1000, seed=8)
    expected = [o.token_ids for o in LLM(model, device="cpu").generate(prompts, params)]
    for i, prompt in enumerate(prompts):
        first, pages_p = prefill(engine_p, f"r{i}", prompt, params)
        pages_d = engine_d.reserve_pages(len(prompt))
        kv = KVStager([engine_p.kv_pool]).gather([pages_p])
        KVStager([engine_d.kv_pool]).scatter([pages_d], kv)
        assert engine_p.release_held(f"r{i}") == pages_p
        output = engine_d.add_prebuilt(f"r{i}", prompt, params, pages_d, first)
        rest = run_to_end(engine_d)[f"r{i}"]
        assert [first, *rest] == expected[i] and output.new_token_ids == [first]
    assert engine_p.kv_pages_in_use == 0 and engine_d.kv_pages_in_use == 0


def test_handoff_over_the_tcp_transfer_layer_equals_colocated(engines):
    engine_p, engine_d, model = engines
    pool = engine_p.kv_pool
    layout = KVLayout(
        "tiny",
        pool.num_layers,
        pool.num_kv_heads,
        pool.head_dim,
        pool.page_size,
        "float32",
        SpecLayout(),
    )
    config = TransferConfig(
        bootstrap_port=0, progress_timeout_s=10, peer_timeout_s=5, heartbeat_interval_s=0.5
    )
    server = PrefillTransferServer(config, layout, MetadataSpec(), "p")
    server.start()
    stager_d = KVStager([engine_d.kv_pool])
    client = DecodeTransferClient(config, layout, MetadataSpec(), "d", stager_d.page_bytes)
    client.start()
    try:
        prompt = random_prompts((29,), 1000, seed=9)[0]
        expected = LLM(model, device="cpu").generate([prompt], GREEDY)[0].token_ids
        pages_d = engine_d.reserve_pages(len(prompt))  # decode reserves first
        receiver = client.receiver(77, "127.0.0.1", server.port, pages_d)
        sender = server.sender(77)
        wait_until(lambda: sender.poll() is TransferState.WAITING_FOR_INPUT, "reservation", 10)
        first, pages_p = prefill(engine_p, "t", prompt)  # prefill computes only now
        sender.send(KVStager([engine_p.kv_pool]).gather([pages_p]), MetadataRecord(first))
        wait_until(lambda: receiver.poll() is TransferState.SUCCESS, "the transfer", 10)
        wait_until(lambda: sender.poll() is TransferState.SUCCESS, "the ack", 10)
        engine_p.release_held("t")
        record = receiver.commit(stager_d)
        engine_d.add_prebuilt("t", prompt, GREEDY, pages_d, record.first_token)
        assert [record.first_token, *run_to_end(engine_d)["t"]] == expected
        assert engine_p.kv_pages_in_use == 0 and engine_d.kv_pages_in_use == 0
    finally:
        client.stop()
        server.stop()


def test_prebuilt_request_needs_pages_for_its_prompt(engines):
    _, engine_d, _ = engines
    pages = engine_d.reserve_pages(4)
    with pytest.raises(InvalidRequestError, match="cannot hold"):
        engine_d.add_prebuilt("short", list(range(10, 30)), GREEDY, pages, 5)
    engine_d.free_pages(pages)
    assert engine_d.kv_pages_in_use == 0


def test_prebuilt_request_that_ends_on_its_first_token_frees_its_pages(engines):
    _, engine_d, _ = engines
    pages = engine_d.reserve_pages(8)
    one = dataclasses.replace(GREEDY, max_new_tokens=1)
    output = engine_d.add_prebuilt("one", list(range(10, 18)), one, pages, 42)
    assert output.finished and output.finish_reason == "length"
    assert output.token_ids == [42] and engine_d.kv_pages_in_use == 0


def test_first_token_output_keeps_its_own_logprobs_after_the_next_step(engines):
    """The decode engine reports the handed-over first token and then runs a step before the
    outputs go out (one loop turn): the first output must still carry the first token's
    logprob and top logprobs, not the second token's (they were slices taken too late)."""
    from pdserve.server.engine_process import _to_wire

    engine_p, engine_d, _ = engines
    (prompt,) = random_prompts((9,), 1000, seed=3)
    params = dataclasses.replace(GREEDY, max_new_tokens=4, logprobs=2)
    engine_p.add_request(
        "lp", prompt, dataclasses.replace(params, max_new_tokens=1), hold_pages=True
    )
    (held,) = [o for o in engine_p.step() if o.request_id == "lp"]
    pages_p = engine_p.held["lp"].pages
    pages_d = engine_d.reserve_pages(len(prompt))
    KVStager([engine_d.kv_pool]).scatter([pages_d], KVStager([engine_p.kv_pool]).gather([pages_p]))
    engine_p.release_held("lp")
    first_top = dict(held.top_logprobs[0])
    first = engine_d.add_prebuilt(
        "lp", prompt, params, pages_d, held.token_ids[0], held.logprobs[0], first_top
    )
    (second,) = engine_d.step()
    wire_first, wire_second = _to_wire(first), _to_wire(second)
    assert wire_first.new_logprobs == [held.logprobs[0]]
    assert dict(map(tuple, wire_first.new_top_logprobs[0])) == first_top
    # Greedy: the chosen token heads its own top list.
    assert max(first_top, key=first_top.get) == held.token_ids[0]
    assert wire_second.new_logprobs == [second.logprobs[1]] != wire_first.new_logprobs
    run_to_end(engine_d)
