"""One msgpack codec for every wire message: a type tag, a protocol version, schema checks.

Decoding never trusts the peer: msgpack's own limits cap every string, byte string, array and
map before anything is allocated; then each field is checked against the dataclass's declared
type (ints are ints, lists hold what they say, nothing missing, nothing unknown). No pickle.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import msgpack

PROTOCOL_VERSION = 1
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
    if not dataclasses.is_dataclass(msg) or getattr(type(msg), "TAG", None) not in _REGISTRY:
        raise ProtocolError(f"cannot encode {type(msg).__name__}")
    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}


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


def _build(cls: type[M], body: Any, where: str) -> M:
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: body must be a map")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(body) - names
    if unknown:
        raise ProtocolError(f"{where}: unknown fields {sorted(map(str, unknown))}")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{where}: missing field {f.name!r}")
            continue
        values[f.name] = _check(body[f.name], hints[f.name], f"{where}.{f.name}")
    return cls(**values)


def _check(value: Any, hint: Any, where: str) -> Any:
    origin = get_origin(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        for option in get_args(hint):
            try:
                return _check(value, option, where)
            except ProtocolError:
                continue
        raise ProtocolError(f"{where}: {type(value).__name__} does not match {hint}")
    if isinstance(hint, type) and hint in _REGISTRY.values():
        return _build(hint, value, where)
    if hint is type(None):
        if value is not None:
            raise ProtocolError(f"{where}: expected nil")
        return None
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected an array, got {type(value).__name__}")
        args = get_args(hint)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ProtocolError(f"{where}: expected {len(args)} items")
            return tuple(
                _check(v, a, f"{where}[{i}]")
                for i, (v, a) in enumerate(zip(value, args, strict=True))
            )
        item = args[0] if args else Any
        checked = [_check(v, item, f"{where}[]") for v in value] if item is not Any else value
        return tuple(checked) if origin is tuple else checked
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map")
        key_type, value_type = get_args(hint) or (Any, Any)
        return {
            _check(k, key_type, f"{where} key"): _check(v, value_type, f"{where}[{k!r}]")
            for k, v in value.items()
        }
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected an integer, got {type(value).__name__}")
        return value
    if hint in (str, bool, bytes):
        if type(value) is not hint:
            raise ProtocolError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        return value
    raise ProtocolError(f"{where}: unsupported schema type {hint}")


__all__ = ["MAX_MESSAGE_BYTES", "PROTOCOL_VERSION", "ProtocolError", "decode", "encode", "message"]
