"""The algorithm registry: built-ins plus third-party plugins, by name.

Plugins register with the `@register` decorator or through the `pdserve.speculative` entry
point group (each entry point loads to an algorithm class). Refused at registration, with a
message naming the problem: a reserved or duplicate name, a class that is not a
`SpeculativeAlgorithm`, one without capabilities, and one that does not implement
`build_disagg_draft_input` (no silent None at decode time).
"""

from __future__ import annotations

import importlib.metadata
import threading

from pdserve.speculative.algorithm import Capabilities, SpeculativeAlgorithm

ENTRY_POINT_GROUP = "pdserve.speculative"
# Names only pdserve itself may register (its built-ins, and "NONE" for no speculation).
RESERVED = frozenset({"NONE", "EAGLE", "EAGLE3", "STANDALONE", "NGRAM"})


class RegistrationError(ValueError):
    """An algorithm class that cannot be registered; the message says why."""


class UnknownAlgorithm(KeyError):
    """No algorithm of that name is registered."""


_algorithms: dict[str, type[SpeculativeAlgorithm]] = {}
_lock = threading.Lock()
_entry_points_loaded = False
_builtins_loaded = False


def register(cls: type[SpeculativeAlgorithm]) -> type[SpeculativeAlgorithm]:
    """Class decorator for third-party algorithms."""
    _add(cls)
    return cls


def get(name: str) -> type[SpeculativeAlgorithm]:
    _load_builtins()
    load_entry_points()
    with _lock:
        if name not in _algorithms:
            known = ", ".join(sorted(_algorithms)) or "none"
            raise UnknownAlgorithm(f"unknown speculative algorithm {name!r}; registered: {known}")
        return _algorithms[name]


def names() -> list[str]:
    _load_builtins()
    load_entry_points()
    with _lock:
        return sorted(_algorithms)


def load_entry_points() -> None:
    """Register every plugin of the entry point group, once per process."""
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        cls = entry.load()
        if getattr(cls, "name", None) != entry.name:
            raise RegistrationError(
                f"entry point {entry.name!r} loads {cls!r}, whose name is "
                f"{getattr(cls, 'name', None)!r}; they must match"
            )
        if _algorithms.get(entry.name) is not cls:
            register(cls)


def unregister(name: str) -> None:
    """Forget a third-party algorithm (tests; built-ins stay)."""
    if name in RESERVED:
        raise RegistrationError(f"{name!r} is a built-in and cannot be unregistered")
    with _lock:
        _algorithms.pop(name, None)


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    from pdserve.speculative.eagle import Eagle, Eagle3
    from pdserve.speculative.ngram import Ngram
    from pdserve.speculative.standalone import Standalone

    with _lock:
        if _builtins_loaded:
            return
        _builtins_loaded = True
    for cls in (Eagle, Eagle3, Standalone, Ngram):
        _add(cls, builtin=True)


def _add(cls: type, *, builtin: bool = False) -> None:
    if not isinstance(cls, type) or not issubclass(cls, SpeculativeAlgorithm):
        raise RegistrationError(f"{cls!r} is not a SpeculativeAlgorithm subclass")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise RegistrationError(f"{cls.__name__} has no `name`")
    if name.upper() in RESERVED and not builtin:
        raise RegistrationError(f"{name!r} is reserved for pdserve's built-in algorithms")
    if not isinstance(getattr(cls, "capabilities", None), Capabilities):
        raise RegistrationError(f"{cls.__name__} has no `capabilities` (a Capabilities)")
    hook = getattr(cls, "build_disagg_draft_input", None)
    if hook is None or getattr(hook, "__isabstractmethod__", False):
        raise RegistrationError(
            f"{cls.__name__} does not implement build_disagg_draft_input; every algorithm "
            "must, so that disaggregated decode never starts from a missing draft input"
        )
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise RegistrationError(f"{cls.__name__} does not implement {', '.join(missing)}")
    with _lock:
        if name in _algorithms:
            raise RegistrationError(f"a speculative algorithm named {name!r} is registered")
        _algorithms[name] = cls
