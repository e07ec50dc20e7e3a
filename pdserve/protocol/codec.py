"""One msgpack codec for every wire message: a type tag, a protocol version, schema checks.

Decoding never trusts the peer: msgpack's own limits cap every string, byte string, array and
map before anything is allocated; then each field is checked against the dataclass's declared
type (ints are ints, lists hold what they say, nothing missing, nothing unknown). No pickle.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
from collections.abc import Callable
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import msgpack

PROTOCOL_VERSION = 6
MAX_MESSAGE_BYTES = 64 << 20
MAX_ITEMS = 1 << 22  # longest list or map a peer may send (e.g. a 4M-token prompt)
MAX_STR = 16 << 20

M = TypeVar("M")


class ProtocolError(ValueError):
    """A message is malformed, oversize, of an unknown type or of another protocol version."""


_REGISTRY: dict[str, type] = {}


def message(tag: str):
    """Class decorator: register a frozen dataclass as a wire message under `tag`."""

    def register(cls: type[M]) -> type[M]:
        if tag in _REGISTRY:
            raise ValueError(f"message tag {tag!r} is already registered")
        cls = dataclasses.dataclass(frozen=True)(cls)
        cls.TAG = tag
        _REGISTRY[tag] = cls
        return cls

    return register


def encode(msg: Any) -> bytes:
    if getattr(type(msg), "TAG", None) not in _REGISTRY:
        raise ProtocolError(f"{type(msg).__name__} is not a registered wire message")
    envelope = {"t": msg.TAG, "v": PROTOCOL_VERSION, "b": _fields(msg)}
    return msgpack.packb(envelope, use_bin_type=True, default=_fields)


def _fields(msg: Any) -> dict[str, Any]:
    """A message's body; nested messages become maps the same way (msgpack's default hook)."""
    body = _body_maker(type(msg))
    if body is None:
        raise ProtocolError(f"cannot encode {type(msg).__name__}")
    return body(msg)


@functools.cache
def _body_maker(cls: type) -> Callable[[Any], dict[str, Any]] | None:
    """For a registered message class, a function from a message to its body, made once per
    class (an engine step's outputs are hundreds of messages); None for any other class."""
    if not dataclasses.is_dataclass(cls) or getattr(cls, "TAG", None) not in _REGISTRY:
        return None
    names = tuple(f.name for f in dataclasses.fields(cls))
    count = len(names)

    def body(msg: Any) -> dict[str, Any]:
        # NOTE: a message's attributes are its fields, set in order by its __init__: then
        # the instance's own dict is the body (msgpack only reads it). Anything else set on
        # it later stays off the wire.
        attributes = msg.__dict__
        if len(attributes) == count:
            return attributes
        return {name: attributes[name] for name in names}

    return body


def decode(data: bytes, expected: type[M] | tuple[type, ...] | None = None) -> M:
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_STR,
            max_bin_len=MAX_MESSAGE_BYTES,
            max_array_len=MAX_ITEMS,
            max_map_len=MAX_ITEMS,
        )
    except (
        ValueError,
        msgpack.exceptions.ExtraData,
        msgpack.exceptions.FormatError,
        msgpack.exceptions.StackError,
    ) as e:
        raise ProtocolError(f"undecodable message: {e}") from None
    if not isinstance(raw, dict) or set(raw) != {"t", "v", "b"}:
        raise ProtocolError("a message is a map with exactly the keys t, v, b")
    if raw["v"] != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {raw['v']!r} != ours ({PROTOCOL_VERSION})")
    cls = _REGISTRY.get(raw["t"]) if isinstance(raw["t"], str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {raw['t']!r}")
    if expected is not None and not issubclass(cls, expected):
        raise ProtocolError(f"unexpected message type {raw['t']!r}")
    return _build(cls, raw["b"], cls.TAG)


@functools.cache
def _schema(cls: type, where: str) -> tuple[frozenset, tuple[tuple[str, Any, bool, str], ...]]:
    """Field names, and per field (name, checker, required, path for errors); resolved once
    per class and position in a message, not per message."""
    hints = get_type_hints(cls)
    fields = tuple(
        (
            f.name,
            _checker(hints[f.name]),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            f"{where}.{f.name}",
        )
        for f in dataclasses.fields(cls)
    )
    return frozenset(f.name for f in dataclasses.fields(cls)), fields


def _build(cls: type[M], body: Any, where: str) -> M:
    if type(body) is not dict:
        raise ProtocolError(f"{where}: body must be a map")
    names, fields = _schema(cls, where)
    if not names.issuperset(body):
        raise ProtocolError(f"{where}: unknown fields {sorted(map(str, set(body) - names))}")
    values = {}
    for name, check, required, path in fields:
        if name in body:
            values[name] = check(body[name], path)
        elif required:
            raise ProtocolError(f"{where}: missing field {name!r}")
    return cls(**values)


@functools.cache
def _shape_test(hint: Any) -> Callable[[Any], bool]:
    """A cheap top-level test, built once per type: could a value be of `hint` at all
    (before its full check)? A union's check takes the first option whose shape matches."""
    origin = get_origin(hint) or hint
    if hint is Any:
        return lambda value: True
    if hint is type(None):
        return lambda value: value is None
    if hint is float:
        return lambda value: type(value) is float or type(value) is int
    if origin in (list, tuple):
        return lambda value: type(value) is list
    if origin is dict or hint in _REGISTRY.values():
        return lambda value: type(value) is dict
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        value_types = frozenset(type(member.value) for member in hint)
        return lambda value: type(value) in value_types
    return lambda value: type(value) is origin


# NOTE: per item type, the value types its checker returns unchanged: a list of only those is
# checked with one pass over its items' types, not a checker call per item (id lists,
# logprobs). An int among floats goes the slow way, to be made a float.
_ITEMS_KEPT_AS_THEY_ARE = {
    int: frozenset({int}),
    str: frozenset({str}),
    float: frozenset({float}),
    int | float: frozenset({int, float}),
}


@functools.cache
def _checker(hint: Any):
    """A function (value, where) -> value that validates against `hint`; built once per type
    so decoding a message costs a few type tests per field, not a walk over `typing`."""
    origin = get_origin(hint)
    if hint is Any:
        return lambda value, where: value
    if isinstance(hint, type) and hint in _REGISTRY.values():
        return lambda value, where: _build(hint, value, where)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):

        def check_enum(value, where):
            # NOTE: the exact type first: True == 1, and 1 would select an int member.
            if not any(type(value) is type(member.value) for member in hint):
                raise ProtocolError(f"{where}: {type(value).__name__} is not a {hint.__name__}")
            try:
                return hint(value)
            except ValueError:
                names = ", ".join(repr(m.value) for m in hint)
                raise ProtocolError(f"{where}: {value!r} is not one of {names}") from None

        return check_enum
    if origin in (Union, types.UnionType):
        options = [(_shape_test(option), _checker(option)) for option in get_args(hint)]

        def check_union(value, where):
            for matches, check in options:
                if matches(value):
                    return check(value, where)
            raise ProtocolError(f"{where}: {type(value).__name__} does not match {hint}")

        return check_union
    if origin in (list, tuple):
        args = get_args(hint)
        if origin is tuple and args and args[-1] is not Ellipsis:
            raise ProtocolError(f"unsupported schema type {hint}")
        item = args[0] if args else Any
        item_check = _checker(item)
        as_tuple = origin is tuple
        kept = _ITEMS_KEPT_AS_THEY_ARE.get(item)

        def check_list(value, where):
            if type(value) is not list:
                raise ProtocolError(f"{where}: expected an array, got {type(value).__name__}")
            if item is Any or (kept is not None and all(type(v) in kept for v in value)):
                checked = value  # NOTE: bool is not an int here (exact types)
            else:
                checked = [item_check(v, f"{where}[]") for v in value]
            return tuple(checked) if as_tuple else checked

        return check_list
    if origin is dict:
        key_type, value_type = get_args(hint) or (Any, Any)
        key_check, value_check = _checker(key_type), _checker(value_type)

        def check_dict(value, where):
            if type(value) is not dict:
                raise ProtocolError(f"{where}: expected a map")
            return {
                key_check(k, f"{where} key"): value_check(v, f"{where}[{k!r}]")
                for k, v in value.items()
            }

        return check_dict
    if hint is type(None):

        def check_none(value, where):
            if value is not None:
                raise ProtocolError(f"{where}: expected nil")

        return check_none
    if hint is float:

        def check_float(value, where):
            if type(value) not in (int, float):
                raise ProtocolError(f"{where}: expected a number, got {type(value).__name__}")
            return float(value)

        return check_float
    if hint is int:

        def check_int(value, where):
            if type(value) is not int:
                raise ProtocolError(f"{where}: expected an integer, got {type(value).__name__}")
            return value

        return check_int
    if hint in (str, bool, bytes):

        def check_exact(value, where):
            if type(value) is not hint:
                raise ProtocolError(
                    f"{where}: expected {hint.__name__}, got {type(value).__name__}"
                )
            return value

        return check_exact
    raise ProtocolError(f"unsupported schema type {hint}")


__all__ = ["MAX_MESSAGE_BYTES", "PROTOCOL_VERSION", "ProtocolError", "decode", "encode", "message"]
