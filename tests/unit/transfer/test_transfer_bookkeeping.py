"""Room states, deadlines, tombstones, handshake comparison and metadata sizing (torch-free)."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.protocol.codec import decode, encode
from pdserve.protocol.failures import Failure, FailureKind, FailureStage
from pdserve.protocol.metadata_spec import MetadataSpec, MetadataSpecError
from pdserve.protocol.transfer_messages import KVLayout, SpecLayout
from pdserve.transfer.handshake import layout_mismatches, model_fingerprint
from pdserve.transfer.room_state import (
    InvalidTransition,
    RoomState,
    Tombstones,
    TransferState,
    room_failure,
)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_states_move_forward_only():
    room = RoomState(7, progress_timeout_s=5)
    assert room.advance(TransferState.WAITING_FOR_INPUT)
    assert room.advance(TransferState.SUCCESS)  # skipping ahead is forward
    with pytest.raises(InvalidTransition):
        room.advance(TransferState.TRANSFERRING)


def test_backwards_and_repeated_states_are_refused():
    room = RoomState(7, progress_timeout_s=5)
    room.advance(TransferState.TRANSFERRING)
    for state in (TransferState.BOOTSTRAPPING, TransferState.TRANSFERRING):
        with pytest.raises(InvalidTransition):
            room.advance(state)
    with pytest.raises(InvalidTransition):
        room.advance(TransferState.FAILED)


def test_failed_is_sticky_and_keeps_the_first_reason():
    room = RoomState(7, progress_timeout_s=5)
    assert room.fail(room_failure("peer aborted", FailureKind.ABORTED))
    assert not room.fail(room_failure("second reason", FailureKind.TIMEOUT))
    assert not room.advance(TransferState.SUCCESS)
    assert room.state is TransferState.FAILED
    assert room.failure == Failure(FailureKind.ABORTED, FailureStage.BOOTSTRAP, "peer aborted")


def test_a_failure_after_bytes_moved_is_a_transfer_failure():
    room = RoomState(7, progress_timeout_s=5)
    room.advance(TransferState.TRANSFERRING)
    room.fail(room_failure("peer silent", FailureKind.PEER_LOST))
    assert (
        room.failure.stage is FailureStage.TRANSFER and room.failure.label == "transfer/peer_lost"
    )


def test_success_is_final_and_cannot_fail_later():
    room = RoomState(7, progress_timeout_s=5)
    room.advance(TransferState.SUCCESS)
    assert not room.fail(room_failure("late abort", FailureKind.ABORTED))
    assert room.state is TransferState.SUCCESS


def test_deadline_fails_a_stuck_room_naming_its_state():
    clock = FakeClock()
    room = RoomState(9, progress_timeout_s=2.0, clock=clock)
    clock.now += 1.5
    assert not room.check_deadline()
    room.advance(TransferState.TRANSFERRING)  # progress resets the clock
    clock.now += 1.9
    assert not room.check_deadline()
    clock.now += 0.2
    assert room.check_deadline()
    assert room.state is TransferState.FAILED
    assert room.failure.kind is FailureKind.TIMEOUT
    assert "TRANSFERRING" in room.failure.message and "2 s" in room.failure.message


def test_tombstones_expire_and_are_bounded():
    clock = FakeClock()
    tombstones = Tombstones(ttl_s=10, capacity=3, clock=clock)
    tombstones.add(1)
    clock.now += 5
    tombstones.add(2)
    assert 1 in tombstones and 2 in tombstones and 3 not in tombstones
    clock.now += 6
    assert 1 not in tombstones and 2 in tombstones
    for room in (3, 4, 5):
        tombstones.add(room)
    assert len(tombstones) == 3 and 2 not in tombstones


def layout(**changes) -> KVLayout:
    spec_changes = {k[5:]: changes.pop(k) for k in list(changes) if k.startswith("spec_")}
    spec = SpecLayout(
        algorithm="EAGLE",
        topk=4,
        num_steps=3,
        spec_hidden_size=64,
        hidden_dtype="bfloat16",
        has_draft_kv=True,
        draft_num_layers=1,
    )
    base = KVLayout(
        model_fingerprint="abc",
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        page_size=16,
        kv_dtype="bfloat16",
        spec=spec,
    )
    return dataclasses.replace(base, spec=dataclasses.replace(spec, **spec_changes), **changes)


@pytest.mark.parametrize(
    ("changes", "field", "prefill_value", "decode_value"),
    [
        ({"page_size": 32}, "page_size", "16", "32"),
        ({"kv_dtype": "float16"}, "kv_dtype", "'bfloat16'", "'float16'"),
        ({"num_layers": 3}, "num_layers", "2", "3"),
        ({"spec_spec_hidden_size": 128}, "spec.spec_hidden_size", "64", "128"),
        ({"spec_topk": 1}, "spec.topk", "4", "1"),
        ({"spec_algorithm": "NGRAM"}, "spec.algorithm", "'EAGLE'", "'NGRAM'"),
    ],
)
def test_a_layout_mismatch_names_field_and_both_values(changes, field, prefill_value, decode_value):
    found = layout_mismatches(layout(), layout(**changes))
    assert found == [f"{field}: prefill {prefill_value} != decode {decode_value}"]


def test_identical_layouts_match_and_every_mismatch_is_listed():
    assert layout_mismatches(layout(), layout()) == []
    assert len(layout_mismatches(layout(), layout(page_size=1, head_dim=8, spec_topk=2))) == 3


def test_layout_round_trips_the_wire():
    assert decode(encode(layout()), KVLayout) == layout()


def test_fingerprint_depends_on_shape_not_on_unrelated_keys():
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}
    assert model_fingerprint(config) == model_fingerprint({**config, "_name_or_path": "/x"})
    assert model_fingerprint(config) != model_fingerprint({**config, "num_hidden_layers": 3})


DRAFT = {"hidden_size": 32}


def test_metadata_hidden_width_comes_from_the_draft_and_hc_mult_doubles_it():
    eagle = MetadataSpec.for_algorithm(
        seeds_topk=True, carries_hidden=True, topk=4, draft_config=DRAFT, hidden_dtype="bfloat16"
    )
    assert (eagle.topk, eagle.hidden_size) == (4, 32)
    doubled = MetadataSpec.for_algorithm(
        seeds_topk=True,
        carries_hidden=True,
        topk=4,
        draft_config={**DRAFT, "hc_mult": 2},
        hidden_dtype="bfloat16",
    )
    assert doubled.hidden_size == 64
    assert doubled.nbytes == 4 * 12 + 64 * 2


def test_metadata_without_hidden_state_is_none_end_to_end():
    standalone = MetadataSpec.for_algorithm(
        seeds_topk=True, carries_hidden=False, topk=1, draft_config=DRAFT, hidden_dtype="bfloat16"
    )
    assert standalone.hidden_size is None and standalone.hidden_dtype is None
    ngram = MetadataSpec.for_algorithm(
        seeds_topk=False, carries_hidden=False, topk=4, draft_config=None, hidden_dtype=None
    )
    assert ngram == MetadataSpec() and ngram.nbytes == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"topk": 17},
        {"hidden_size": 32},
        {"hidden_size": 0, "hidden_dtype": "bfloat16"},
    ],
)
def test_metadata_spec_rejects_inconsistent_settings(kwargs):
    with pytest.raises(MetadataSpecError):
        MetadataSpec(**kwargs)


def test_hidden_state_algorithms_need_a_draft_config():
    with pytest.raises(MetadataSpecError, match="draft config"):
        MetadataSpec.for_algorithm(
            seeds_topk=True, carries_hidden=True, topk=1, draft_config=None, hidden_dtype="bfloat16"
        )
