"""A transfer backend's name is read in one place, `make_backend` (docs: "a backend is a
folder"): outside pdserve/transfer/backends/, code asks the backend object for a fact instead
of branching on its name. Read from the source (every string constant, by the AST: comments
and docstrings do not count), so that a new `if backend == "..."` anywhere fails here, named
by file and line; each place allowed says why."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pdserve
from pdserve.transfer.backends import BACKENDS

PACKAGE = Path(pdserve.__file__).parent
BACKENDS_FOLDER = PACKAGE / "transfer" / "backends"
NAMES = frozenset(BACKENDS) | {"tcp", "nccl", "gloo", "ipc", "memory"}

# (file, backend name, "comparison" or "value") -> (how many, why it may stay).
ALLOWED: dict[tuple[str, str, str], tuple[int, str]] = {
    ("pdserve/launch.py", "nccl", "comparison"): (
        1,
        "GPU placement: an NCCL group of two cannot join two processes on one GPU, which the "
        "launcher checks before it starts any (a fact about the launch plan, not the backend)",
    ),
    ("pdserve/transfer/config.py", "tcp", "value"): (1, "the default of --transfer-backend"),
    ("pdserve/protocol/transfer_messages.py", "tcp", "value"): (
        1,
        "Register.backend's default on the wire (protocol/ may not import transfer/)",
    ),
}


def backend_names_in(source: str) -> list[tuple[int, str, str]]:
    """(line, name, kind) of every string constant that is a backend's name: "comparison"
    inside a comparison or a `match` case, else "value". Docstrings are left out."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    in_comparison = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Compare, ast.match_case)):
            scope = node.pattern if isinstance(node, ast.match_case) else node
            in_comparison.update(id(child) for child in ast.walk(scope))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in NAMES and id(node) not in docstrings:
            kind = "comparison" if id(node) in in_comparison else "value"
            found.append((node.lineno, node.value, kind))
    return sorted(found)


def test_the_checker_finds_comparisons_and_values_but_not_prose():
    source = (
        '"""tcp"""\n'
        "# if backend == 'ipc'\n"
        "if config.backend == 'nccl' or name in ('ipc', 'memory'):\n"
        "    pass\n"
        "match name:\n"
        "    case 'gloo':\n"
        "        pass\n"
        "default = 'tcp'\n"
        "label = 'tcp://host'\n"
    )
    assert backend_names_in(source) == [
        (3, "ipc", "comparison"),
        (3, "memory", "comparison"),
        (3, "nccl", "comparison"),
        (6, "gloo", "comparison"),
        (8, "tcp", "value"),
    ]


def test_backend_names_are_read_only_by_the_backends_and_the_allowed_places():
    found: Counter = Counter()
    where: dict[tuple[str, str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if BACKENDS_FOLDER in path.parents:
            continue
        relative = path.relative_to(PACKAGE.parent).as_posix()
        for line, name, kind in backend_names_in(path.read_text()):
            found[(relative, name, kind)] += 1
            where.setdefault((relative, name, kind), []).append(f"{relative}:{line} {name!r}")
    allowed = {key: count for key, (count, _) in ALLOWED.items()}
    extra = [
        place for key, count in found.items() if count > allowed.get(key, 0) for place in where[key]
    ]
    assert not extra, (
        "backend names outside pdserve/transfer/backends/ (ask the backend object for the "
        "fact instead, see backends/base.py; or allow the place in ALLOWED with its reason):\n"
        + "\n".join(extra)
    )
    gone = [key for key, count in allowed.items() if found[key] < count]
    assert not gone, f"ALLOWED lists places that no longer exist (remove them): {gone}"
