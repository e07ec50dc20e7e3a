"""Nothing outside `pdserve/engine/` reaches into the engine's scheduler (its queues are the
engine's to change: a request's place is its status), and nothing outside the speculative
package reaches through a speculator to its algorithm (the `Speculator` protocol says what the
engine and the connectors may ask)."""

from __future__ import annotations

import ast
from pathlib import Path

import pdserve

ROOT = Path(pdserve.__file__).parent


def reaches(tree: ast.AST, name: str, owner: str | None = None) -> list[int]:
    """Lines where an attribute `name` is read off something (`x.name`), off an attribute
    named `owner` if given (`x.owner.name`)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr != name:
            continue
        if owner is None or (isinstance(node.value, ast.Attribute) and node.value.attr == owner):
            lines.append(node.lineno)
    return lines


def offenders(name: str, owner: str | None, allowed: str) -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(allowed):
            continue
        for line in reaches(ast.parse(path.read_text(), str(path)), name, owner):
            found.append(f"pdserve/{relative}:{line}")
    return found


def test_nothing_outside_the_engine_reaches_into_its_scheduler():
    assert offenders("scheduler", None, "engine/") == []


def test_nothing_outside_the_speculative_package_reaches_a_speculators_algorithm():
    assert offenders("algorithm", "speculator", "speculative/") == []


def test_the_check_finds_a_reach_through():
    """The walk sees what it is meant to catch (so the checks above can fail)."""
    tree = ast.parse(
        "def f(engine):\n    return engine.scheduler.running, engine.speculator.algorithm\n"
    )
    assert reaches(tree, "scheduler") == [2]
    assert reaches(tree, "algorithm", "speculator") == [2]
    assert reaches(ast.parse("x.algorithm"), "algorithm", "speculator") == []
