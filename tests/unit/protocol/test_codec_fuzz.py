"""Property-based fuzzing of every wire message (engine and transfer) through the codec:
valid messages round-trip, and random or mutated input never raises anything but
ProtocolError."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.protocol import engine_messages, failures, transfer_messages
from pdserve.protocol.codec import PROTOCOL_VERSION, ProtocolError, decode, encode

MESSAGES = [
    cls
    for module in (engine_messages, transfer_messages, failures)
    for cls in vars(module).values()
    if isinstance(cls, type) and dataclasses.is_dataclass(cls) and hasattr(cls, "TAG")
]
FUZZ = settings(max_examples=25, deadline=None)
INT64 = st.integers(-(1 << 63), (1 << 63) - 1)
# Any msgpack value a peer could send in place of a field.
ANY_VALUE = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


def values_of(hint) -> st.SearchStrategy:
    """Valid values for a field of this type."""
    origin = get_origin(hint)
    if hint is Any:
        return st.none() | INT64 | st.text(max_size=8)
    if origin in (Union, types.UnionType):
        return st.one_of([values_of(option) for option in get_args(hint)])
    if origin is list:
        return st.lists(values_of(get_args(hint)[0]), max_size=4)
    if origin is tuple:
        return st.lists(values_of(get_args(hint)[0]), max_size=4).map(tuple)
    if origin is dict:
        key, value = get_args(hint)
        return st.dictionaries(values_of(key), values_of(value), max_size=3)
    if dataclasses.is_dataclass(hint):
        return messages_of(hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return st.sampled_from(list(hint))
    simple = {
        int: INT64,
        float: st.floats(allow_nan=False),
        str: st.text(max_size=16),
        bytes: st.binary(max_size=32),
        bool: st.booleans(),
        type(None): st.none(),
    }
    return simple[hint]


def messages_of(cls) -> st.SearchStrategy:
    hints = get_type_hints(cls)
    fields = {f.name: values_of(hints[f.name]) for f in dataclasses.fields(cls)}
    return st.fixed_dictionaries(fields).map(lambda kwargs: cls(**kwargs))


def decodes_or_refuses(data: bytes) -> None:
    """Decoding either succeeds or raises ProtocolError; anything else fails the test."""
    with contextlib.suppress(ProtocolError):
        decode(data)


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda cls: cls.TAG)
@FUZZ
@given(data=st.data())
def test_valid_messages_round_trip(cls, data):
    msg = data.draw(messages_of(cls))
    assert decode(encode(msg), cls) == msg


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda cls: cls.TAG)
@FUZZ
@given(data=st.data())
def test_mutated_messages_decode_or_raise_protocol_error(cls, data):
    body = msgpack.unpackb(encode(data.draw(messages_of(cls))))["b"]
    names = sorted(body)
    action = data.draw(st.sampled_from(["replace", "drop", "add", "version", "tag"]))
    if action == "replace" and names:
        body[data.draw(st.sampled_from(names))] = data.draw(ANY_VALUE)
    elif action == "drop" and names:
        del body[data.draw(st.sampled_from(names))]
    elif action == "add":
        body[data.draw(st.text(max_size=6))] = data.draw(ANY_VALUE)
    envelope = {"t": cls.TAG, "v": PROTOCOL_VERSION, "b": body}
    if action == "version":
        envelope["v"] = data.draw(ANY_VALUE)
    elif action == "tag":
        envelope["t"] = data.draw(ANY_VALUE)
    decodes_or_refuses(msgpack.packb(envelope))


@FUZZ
@given(data=st.binary(max_size=256))
def test_random_bytes_raise_only_protocol_error(data):
    decodes_or_refuses(data)


@FUZZ
@given(value=ANY_VALUE)
def test_random_msgpack_values_raise_only_protocol_error(value):
    decodes_or_refuses(msgpack.packb(value))
