"""`pdserve/transfer/` imports without cycles (every import statement, including those under
TYPE_CHECKING and inside functions), and its rooms are torch-free: a room is state and a
ledger; tensors are the data planes' business."""

from __future__ import annotations

import ast
from pathlib import Path

import pdserve.transfer

TRANSFER = Path(pdserve.transfer.__file__).parent
PACKAGE = TRANSFER.parent
# The rooms and what they are made of.
TORCH_FREE = ("room_state", "sender_room", "receiver_room", "kv_piece", "peer", "outbox")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports (a `from a import b` names a.b if a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & known


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in TRANSFER.rglob("*.py")}
    known = set(paths)
    return {name: imported(path, known) - {name} for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected set of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle_inside_transfer():
    graph = import_graph()
    assert "pdserve.transfer.endpoint" in graph["pdserve.transfer.decode_side"]  # it reads
    assert cycles(graph) == []


def runtime_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import that runs: not those under `if TYPE_CHECKING:`."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            found += [imp for child in node.orelse for imp in runtime_imports(child)]
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
        found += runtime_imports(node)
    return found


def test_the_import_reader_skips_type_checking_imports():
    source = "import a\nif TYPE_CHECKING:\n    import torch\ndef f():\n    from b import c\n"
    assert runtime_imports(ast.parse(source)) == [(1, "a"), (5, "b")]


def test_rooms_import_no_torch():
    importing_torch = [
        f"{name}.py:{line}"
        for name in TORCH_FREE
        for line, module in runtime_imports(ast.parse((TRANSFER / f"{name}.py").read_text()))
        if module == "torch" or module.startswith("torch.")
    ]
    assert importing_torch == []
