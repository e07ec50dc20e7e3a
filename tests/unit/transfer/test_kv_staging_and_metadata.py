"""Page gather/scatter is bit-exact across pools; metadata records round-trip and are checked."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.runtime.kv_pool import KVPool
from pdserve.protocol.metadata_spec import MetadataSpec
from pdserve.transfer.kv_staging import KVStager, StagingError
from pdserve.transfer.metadata import MetadataMismatch, MetadataRecord


def pool(num_pages, page_size=4, layers=3, dtype=torch.bfloat16, seed=None):
    p = KVPool(
        num_layers=layers,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=2,
        head_dim=8,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        p.storage.copy_(torch.randn(p.storage.shape, generator=g).to(dtype))
    return p


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("with_draft", [False, True])
def test_gather_then_scatter_moves_pages_bit_exact(page_size, with_draft):
    src = [pool(20, page_size, seed=1)]
    dst = [pool(30, page_size)]
    src_pages, dst_pages = [[7, 2, 19, 3]], [[0, 29, 11, 5]]
    if with_draft:
        src.append(pool(10, page_size, layers=1, dtype=torch.float32, seed=2))
        dst.append(pool(12, page_size, layers=1, dtype=torch.float32))
        src_pages.append([9, 1])
        dst_pages.append([4, 10])
    buffer = KVStager(src).gather(src_pages)
    assert buffer.dtype == torch.uint8 and buffer.numel() == KVStager(src).nbytes(src_pages)
    KVStager(dst).scatter(dst_pages, buffer.clone())
    for s, d, sp, dp in zip(src, dst, src_pages, dst_pages, strict=True):
        assert torch.equal(s.storage[:, :, sp], d.storage[:, :, dp])
        untouched = [p for p in range(d.num_pages) if p not in dp]
        assert not d.storage[:, :, untouched].any()


def test_staging_rejects_bad_pages_and_sizes():
    stager = KVStager([pool(4)])
    with pytest.raises(StagingError, match="outside"):
        stager.gather([[0, 4]])
    with pytest.raises(StagingError, match="does not match"):
        stager.scatter([[0]], torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(StagingError, match="page lists"):
        stager.nbytes([[0], [1]])


EAGLE = MetadataSpec(topk=3, hidden_size=8, hidden_dtype="bfloat16")


def eagle_record():
    return MetadataRecord(
        first_token=42,
        cached_tokens=5,
        first_logprob=-0.25,
        topk_p=torch.tensor([0.5, 0.3, 0.2]),
        topk_index=torch.tensor([7, 1, 99]),
        hidden_states=torch.randn(8).to(torch.bfloat16),
    )


@pytest.mark.parametrize("topk", [1, 3])
def test_record_with_hidden_states_round_trips(topk):
    spec = MetadataSpec(topk=topk, hidden_size=8, hidden_dtype="bfloat16")
    record = eagle_record()
    record.topk_p, record.topk_index = record.topk_p[:topk], record.topk_index[:topk]
    header, payload = record.pack(room=9, spec=spec)
    back = MetadataRecord.unpack(header, payload, spec)
    assert (back.first_token, back.cached_tokens, back.first_logprob) == (42, 5, -0.25)
    assert torch.equal(back.topk_p, record.topk_p)
    assert torch.equal(back.topk_index, record.topk_index)
    assert torch.equal(back.hidden_states, record.hidden_states)


def test_record_without_hidden_states_round_trips_as_none():
    spec = MetadataSpec(topk=1)
    record = MetadataRecord(3, topk_p=torch.tensor([1.0]), topk_index=torch.tensor([3]))
    back = MetadataRecord.unpack(*record.pack(1, spec), spec)
    assert back.hidden_states is None and back.topk_index.tolist() == [3]
    plain = MetadataRecord(8)
    assert MetadataRecord.unpack(*plain.pack(2, MetadataSpec()), MetadataSpec()).first_token == 8


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_states": None}, "hidden_states is missing"),
        ({"hidden_states": torch.zeros(16, dtype=torch.bfloat16)}, r"hidden_states: got shape"),
        ({"hidden_states": torch.zeros(8)}, "float32"),
        ({"topk_p": torch.zeros(2)}, "topk_p"),
    ],
)
def test_record_that_disagrees_with_the_handshake_is_refused(change, match):
    record = eagle_record()
    for name, value in change.items():
        setattr(record, name, value)
    with pytest.raises(MetadataMismatch, match=match):
        record.pack(1, EAGLE)


def test_hidden_state_for_an_algorithm_without_one_is_refused():
    record = MetadataRecord(1, hidden_states=torch.zeros(4))
    with pytest.raises(MetadataMismatch, match="carries none"):
        record.check(MetadataSpec())


def test_payload_of_the_wrong_length_is_refused_before_use():
    header, payload = eagle_record().pack(1, EAGLE)
    with pytest.raises(MetadataMismatch, match="expected"):
        MetadataRecord.unpack(header, payload + b"\x00" * 1000, EAGLE)
