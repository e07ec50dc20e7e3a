"""docs/architecture.md §1, enforced: which part of `pdserve` may import which, read from the
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
    "transfer": {"protocol"},  # moves bytes between workers; knows no engine
    "engine": {"protocol"},  # the engine and the interfaces it drives (Speculator, KVConnector)
    "speculative": {"engine", "protocol"},  # implements the engine's Speculator
    "disagg": {"engine", "transfer", "protocol"},  # what the prefill and decode roles share
    # The roles: each builds its worker (engine + connector); none imports another, or server.
    "colocated": {"engine", "speculative", "protocol"},
    "prefill": {"disagg", "engine", "speculative", "transfer", "protocol"},
    "decode": {"disagg", "engine", "speculative", "transfer", "protocol"},
    # The HTTP shell and the engine loop: it gets the role's factory, never names a role.
    "server": {"engine", "protocol"},
    "router": {"protocol"},  # a router pod needs no GPU image
    "bench": set(),  # a client for any OpenAI-compatible server: nothing of pdserve, no torch
    # The top: offline LLM, local launcher, command line.
    "llm": {"engine", "speculative", "protocol"},
    # launch hands settings on as flags: it reads the settings of every process it starts.
    "launch": {"server", "engine", "transfer", "router", "protocol"},
    "commands": set(),  # filled below: anything (one module per subcommand)
    "cli": set(),  # filled below: anything
    "pdserve": {"engine", "llm"},  # the root's lazy re-exports (LLM, SamplingParams)
}
LAYERS["commands"] = set(LAYERS) - {"commands", "cli", "pdserve"}
LAYERS["cli"] = set(LAYERS) - {"cli", "pdserve"}

# Units whose import graph must not contain torch (not even deferred).
TORCH_FREE = {"protocol", "router", "bench"}

# Imports that break the table today, each to be removed by the change that fixes it (the test
# fails once one is gone, so this list cannot go stale).
KNOWN_BREAKS: set[tuple[str, str]] = set()


def unit_of(relative: pathlib.PurePath) -> str:
    """`engine/kv_pool.py` -> engine, `cli.py` -> cli, `__init__.py` -> pdserve."""
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
    assert units - set(LAYERS) == set(), "add the new package to LAYERS (and to §1)"
    assert set(LAYERS) - units == set(), "remove the deleted package from LAYERS"


def test_imports_follow_the_layers():
    found = breaks()
    assert found - KNOWN_BREAKS == set(), "imports against docs/architecture.md §1"
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
