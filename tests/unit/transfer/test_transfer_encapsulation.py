"""A room changes only through its own methods: nothing in pdserve outside a room's classes
(`Room`, `RoomState`, `SenderRoom`, `ReceiverRoom` and the `PieceLedger` they hold) writes
an attribute of a room, read from the source. The attributes are those the room classes set
on `self`; a write is `x.name = ...`, `x.name += ...`, `del x.name` or `setattr(x, "name",
...)` with `x` not `self`. A name that only rooms have is flagged whatever `x` is; a name
other classes also have (`peer`, `instance`, ...) when `x` reads as a room (`room`,
`receiver`, `sender`, `entry`, or an attribute chain ending in one)."""

from __future__ import annotations

import ast
from pathlib import Path

import pdserve

PACKAGE = Path(pdserve.__file__).parent
ROOM_CLASSES = {"Room", "RoomState", "SenderRoom", "ReceiverRoom", "PieceLedger"}
ROOM_MODULES = ("transfer/room_state.py", "transfer/sender_room.py", "transfer/receiver_room.py")
ROOM_MODULES += ("transfer/kv_piece.py",)
ROOMISH = ("room", "receiver", "sender", "entry")


def self_attributes(tree: ast.AST, classes: set[str] | None) -> set[str]:
    """Attribute names the classes named (None: every class) set on `self` or declare as
    fields."""
    names = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef) or (classes is not None and cls.name not in classes):
            continue
        for node in cls.body:  # dataclass fields and class attributes
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
        for node in ast.walk(cls):
            for target in _targets(node):
                if isinstance(target.value, ast.Name) and target.value.id == "self":
                    names.add(target.attr)
    return names


def _targets(node: ast.AST) -> list[ast.Attribute]:
    if isinstance(node, ast.Assign):
        found = [t for target in node.targets for t in _flatten(target)]
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = _flatten(node.target)
    elif isinstance(node, ast.Delete):
        found = [t for target in node.targets for t in _flatten(target)]
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "setattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
    ):
        found = [ast.Attribute(node.args[0], node.args[1].value, ast.Store(), lineno=node.lineno)]
    else:
        found = []
    return [t for t in found if isinstance(t, ast.Attribute)]


def _flatten(target: ast.AST) -> list[ast.AST]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for element in target.elts for t in _flatten(element)]
    return [target]


def _reads_as_a_room(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return any(word in name.lower() for word in ROOMISH)


def foreign_room_writes(source: str, room_only: set[str], shared: set[str]) -> list[str]:
    """'line: target' of every write of a room attribute that is not the room's own."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for target in _targets(node):
            base = target.value
            if isinstance(base, ast.Name) and base.id == "self":
                continue  # a class's own attribute (a room's own, inside the room classes)
            if target.attr in room_only or (target.attr in shared and _reads_as_a_room(base)):
                found.append(f"{target.lineno}: {ast.unparse(target)}")
    return found


def room_attributes() -> tuple[set[str], set[str]]:
    """(names only rooms have, names rooms share with other classes)."""
    rooms, others = set(), set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        if str(path.relative_to(PACKAGE)) in ROOM_MODULES:
            rooms |= self_attributes(tree, ROOM_CLASSES)
            others |= self_attributes(tree, None) - self_attributes(tree, ROOM_CLASSES)
        else:
            others |= self_attributes(tree, None)
    return rooms - others, rooms & others


def test_the_checker_finds_writes_into_a_room():
    source = (
        "def f(room, request, peer, x):\n"
        "    room.peer = 1\n"
        "    request.transfer.receiver.entry.released = True\n"
        "    x.writer_pid += 1\n"
        "    setattr(x, 'writer_pid', 2)\n"
        "    peer.peer = 3\n"
        "    self.writer_pid = 4\n"
    )
    found = foreign_room_writes(source, room_only={"writer_pid", "released"}, shared={"peer"})
    assert found == [
        "2: room.peer",
        "3: request.transfer.receiver.entry.released",
        "4: x.writer_pid",
        "5: x.writer_pid",
    ]


def test_the_room_attributes_are_found():
    room_only, shared = room_attributes()
    assert {"retried", "claimed", "expected_bytes"} <= room_only
    assert {"peer", "metadata", "pieces_sent"} <= room_only | shared


def test_nothing_outside_a_room_writes_its_attributes():
    room_only, shared = room_attributes()
    offences = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(PACKAGE))
        if relative in ROOM_MODULES:
            continue  # NOTE: inside them, only `self.x` writes (skipped) are the room's own
        if hits := foreign_room_writes(path.read_text(), room_only, shared):
            offences[relative] = hits
    assert offences == {}
