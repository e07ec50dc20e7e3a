"""docs/architecture/layout.md, enforced: which part of `pdserve` may import which, read from the
source (every import statement, including those inside functions and under TYPE_CHECKING).

A part ("unit") is a package directly under `pdserve/` or a top-level module (`cli`, `llm`,
...); `pdserve` itself is the root `__init__.py`. `LAYERS` lists every unit once, with the
units it may import besides itself; a unit that `LAYERS` does not list fails the test, so a new
package states its place here (and in the architecture page) when it is added.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "pdserve"

# unit -> the units it may import. The order is bottom to top.
LAYERS: dict[str, set[str]] = {
    "protocol": set(),  # wire messages and settings: everyone's, torch-free
    "edge": {"protocol"},  # the HTTP edge router and workers share: API key, JSON, errors, ids
    "transfer": {"protocol"},  # moves bytes between workers; knows no engine
    "engine": {"protocol"},  # the engine and the interfaces it drives (Speculator, KVConnector)
    "synthetic": {"engine"},  # random checkpoints built offline: the tiny model, --preset
    "speculative": {"engine", "protocol"},  # implements the engine's Speculator
    "disagg": {"engine", "transfer", "protocol"},  # what the prefill and decode roles share
    # The roles: each builds its worker (engine + connector); none imports another, or server.
    "colocated": {"engine", "speculative", "protocol"},
    "prefill": {"disagg", "engine", "speculative", "transfer", "protocol"},
    "decode": {"disagg", "engine", "speculative", "transfer", "protocol"},
    # A worker's engine process: builds the role's worker from its factory, runs the loop.
    "engine_process": {"engine", "protocol"},
    # The HTTP shell: it gets the role's factory, never names a role.
    "server": {"engine_process", "engine", "edge", "protocol"},
    "router": {"edge", "protocol"},  # a router pod needs no GPU image
    "bench": set(),  # a client for any OpenAI-compatible server: nothing of pdserve, no torch
    # The top: offline LLM, local launcher, command line.
    "llm": {"engine", "speculative", "synthetic", "protocol"},
    # launch hands settings on as flags: it reads the settings of every process it starts.
    "launch": {"server", "engine", "transfer", "router", "protocol"},
    "commands": set(),  # filled below: anything (one module per subcommand)
    "cli": set(),  # filled below: anything
    "pdserve": {"engine", "llm"},  # the root's lazy re-exports (LLM, SamplingParams)
}
LAYERS["commands"] = set(LAYERS) - {"commands", "cli", "pdserve"}
LAYERS["cli"] = set(LAYERS) - {"cli", "pdserve"}

# Units whose import graph must not contain torch (not even deferred).
TORCH_FREE = {"protocol", "edge", "router", "bench"}

# Imports that break the table today, each to be removed by the change that fixes it (the test
# fails once one is gone, so this list cannot go stale).
KNOWN_BREAKS: set[tuple[str, str]] = set()


def unit_of(relative: pathlib.PurePath) -> str:
    """`engine/runtime/kv_pool.py` -> engine, `cli.py` -> cli, `__init__.py` -> pdserve."""
    if len(relative.parts) > 1:
        return relative.parts[0]
    return "pdserve" if relative.name == "__init__.py" else relative.stem


def imports_of(path: pathlib.Path) -> list[str]:
    """Every module an import statement in the file imports from."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (write it absolute)"
            if node.module == "pdserve":  # `from pdserve import cli` names the module cli
                found.extend(f"pdserve.{alias.name}" for alias in node.names)
            else:
                found.append(node.module)
    return found


def imported_unit(module: str) -> str | None:
    """The unit an imported module belongs to; None outside pdserve and for the root's
    `__version__`, which every unit may read."""
    parts = module.split(".")
    if parts[0] != "pdserve" or module == "pdserve" or parts[1].startswith("__"):
        return None
    # NOTE: any other name imported from the root is one of its re-exports (LLM, ...): the top.
    return parts[1] if parts[1] in LAYERS else "llm"


def source_files() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def breaks() -> set[tuple[str, str]]:
    """(file, module) for every import of a unit that the file's row in LAYERS leaves out."""
    found = set()
    for path in source_files():
        relative = path.relative_to(PACKAGE)
        unit = unit_of(relative)
        for module in imports_of(path):
            target = imported_unit(module)
            if target not in (None, unit) and target not in LAYERS[unit]:
                found.add((relative.as_posix(), module))
    return found


def test_every_unit_has_a_row():
    units = {unit_of(path.relative_to(PACKAGE)) for path in source_files()}
    units |= {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert units - set(LAYERS) == set(), (
        "add the new package to LAYERS (and to docs/architecture/layout.md)"
    )
    assert set(LAYERS) - units == set(), "remove the deleted package from LAYERS"


def test_imports_follow_the_layers():
    found = breaks()
    assert found - KNOWN_BREAKS == set(), "imports against docs/architecture/layout.md"
    assert KNOWN_BREAKS - found == set(), "fixed: remove these from KNOWN_BREAKS"


@pytest.mark.parametrize("unit", sorted(TORCH_FREE))
def test_torch_free_units_never_import_torch(unit):
    for path in source_files():
        if unit_of(path.relative_to(PACKAGE)) == unit:
            torch = [m for m in imports_of(path) if m.split(".")[0] == "torch"]
            assert not torch, f"{path.relative_to(PACKAGE)} imports {torch}"


def test_the_reader_sees_deferred_and_type_checking_imports(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import pdserve\n"
        "from pdserve import LLM, cli\n"
        "if TYPE_CHECKING:\n    from pdserve.server.app import build_app\n"
        "def f():\n    import pdserve.prefill.worker\n"
    )
    named = {imported_unit(m) for m in imports_of(source)}
    assert named == {None, "llm", "cli", "server", "prefill"}


# Inside `engine/`: a part is a subpackage, or "engine" for the modules at its top (the `Engine`
# and the interfaces it drives). The order is bottom to top; no arrow runs back up.
ENGINE = PACKAGE / "engine"
ENGINE_LAYERS: dict[str, set[str]] = {
    "core": set(),  # torch-free bookkeeping: config, requests, scheduler, pages, prefix cache
    "text": {"core"},  # chat templates in, detokenized text out
    "checkpoint": set(),  # model names to directories, config.json, weights
    "kernels": set(),  # Triton kernels
    "parallel": {"kernels"},  # how a model splits over ranks, and the collectives
    "runtime": {"core", "checkpoint", "kernels", "parallel"},  # models, KV, forward, sampling
    "ranks": {"core", "checkpoint", "parallel", "runtime"},  # a tensor-parallel worker's ranks
    "engine": {"core", "text", "checkpoint", "kernels", "parallel", "runtime", "ranks"},
}
ENGINE_TORCH_FREE = {"core", "text"}
ENGINE_TOP_LEVEL_LIMIT = 12  # modules and subpackages directly under engine/

# Import cycles among engine modules (strongly connected sets of two or more), each named by
# its members. The one kept: the interfaces the engine drives name `Engine` in their
# signatures (under TYPE_CHECKING), and the engine (and its start-up) import them.
KNOWN_ENGINE_CYCLES = [
    {"engine.engine", "engine.kv_connector", "engine.speculator", "engine.startup"}
]


def engine_part(module: str) -> str | None:
    """`pdserve.engine.runtime.kv_pool` -> runtime, `pdserve.engine.engine` -> engine; None
    outside engine/."""
    parts = module.split(".")
    if parts[:2] != ["pdserve", "engine"]:
        return None
    if len(parts) == 2 or (ENGINE / f"{parts[2]}.py").is_file():
        return "engine"
    return parts[2]


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def engine_imports(path: pathlib.Path) -> set[str]:
    """The engine modules the file imports, `from package import module` resolved to the
    module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = PACKAGE.parent / node.module.replace(".", "/")
            names = [
                f"{node.module}.{alias.name}"
                if (base / f"{alias.name}.py").is_file() or (base / alias.name).is_dir()
                else node.module
                for alias in node.names
            ]
        found |= {name for name in names if engine_part(name) is not None}
    return found


def engine_graph() -> dict[str, set[str]]:
    """engine module (without the `pdserve.` prefix) -> the engine modules it imports."""
    strip = len("pdserve.")
    return {
        module_name(path)[strip:]: {m[strip:] for m in engine_imports(path)}
        - {module_name(path)[strip:]}
        for path in sorted(ENGINE.rglob("*.py"))
    }


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected sets of two or more nodes (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            members = set()
            while True:
                member = stack.pop()
                members.add(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(members)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_engine_part_has_a_row():
    parts = {engine_part(module_name(path)) for path in ENGINE.rglob("*.py")}
    assert parts == set(ENGINE_LAYERS), (
        "add the new engine/ package to ENGINE_LAYERS (and docs/architecture/layout.md)"
    )


def test_engine_parts_import_downwards_only():
    against = set()
    for path in sorted(ENGINE.rglob("*.py")):
        part = engine_part(module_name(path))
        for module in engine_imports(path):
            target = engine_part(module)
            if target != part and target not in ENGINE_LAYERS[part]:
                against.add((path.relative_to(PACKAGE).as_posix(), module))
    assert against == set(), "imports against ENGINE_LAYERS (docs/architecture/layout.md)"


@pytest.mark.parametrize("part", sorted(ENGINE_TORCH_FREE))
def test_torch_free_engine_parts_never_import_torch(part):
    for path in sorted((ENGINE / part).rglob("*.py")):
        torch = [m for m in imports_of(path) if m.split(".")[0] in ("torch", "triton")]
        assert not torch, f"{path.relative_to(PACKAGE)} imports {torch}"


def test_engine_has_at_most_one_import_cycle():
    found = cycles(engine_graph())
    assert sorted(map(sorted, found)) == sorted(map(sorted, KNOWN_ENGINE_CYCLES))


def test_engine_top_level_stays_small():
    entries = [p for p in ENGINE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()]
    entries = [p for p in entries if p.name != "__init__.py"]
    assert len(entries) <= ENGINE_TOP_LEVEL_LIMIT, sorted(p.name for p in entries)


def test_the_cycle_finder_finds_cycles_and_only_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": {"g"}, "g": {"f"}}
    assert sorted(map(sorted, cycles(graph))) == [["a", "b", "c"], ["f", "g"]]


def test_engine_imports_resolve_modules_named_by_from_imports(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "from pdserve.engine.runtime import cpu_threads\n"
        "from pdserve.engine.core.request import Request\n"
        "import pdserve.engine.ranks.rank_worker\n"
        "from pdserve.protocol import codec\n"
    )
    assert engine_imports(source) == {
        "pdserve.engine.runtime.cpu_threads",
        "pdserve.engine.core.request",
        "pdserve.engine.ranks.rank_worker",
    }
