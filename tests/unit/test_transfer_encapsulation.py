"""In pdserve/transfer/, an object's private attributes (`_name`) are touched only by its own
class (`self._name`): a room's state changes through the room's methods, never by an endpoint
or a data plane reaching into it. torch's own private API is the one exception."""

from __future__ import annotations

import ast
from pathlib import Path

import pdserve.transfer

TRANSFER = Path(pdserve.transfer.__file__).parent
# torch's own API: process-group options are private fields; a view's base is `_base`.
TORCH_PRIVATE_API = {"_Options", "_timeout", "_devices", "_base"}
# torch's storage sharing (the `ipc` backend's pool handles).
TORCH_PRIVATE_API |= {"_share_cuda_", "_share_fd_cpu_", "_new_shared_cuda", "_new_shared_fd_cpu"}


def foreign_private_accesses(source: str) -> list[tuple[int, str]]:
    """(line, text) of every `x._name` whose `x` is not `self` or `cls`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in TORCH_PRIVATE_API:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_checker_finds_a_foreign_private_write():
    source = "def f(room):\n    room._state = 1\n    self._ok = 2\n"
    assert foreign_private_accesses(source) == [(2, "room._state")]


def test_no_transfer_module_touches_another_objects_private_attributes():
    offences = {
        path.name: hits
        for path in sorted(TRANSFER.glob("*.py"))
        if (hits := foreign_private_accesses(path.read_text()))
    }
    assert offences == {}


def test_no_transfer_module_exceeds_300_lines():
    lengths = {path.name: len(path.read_text().splitlines()) for path in TRANSFER.glob("*.py")}
    assert {name: n for name, n in lengths.items() if n > 300} == {}
