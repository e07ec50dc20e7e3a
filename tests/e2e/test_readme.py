"""The README's examples run as written: `.ci/run` runs its two set-up commands exactly, every
`python` block runs, and every command block marked `<!-- runs in tests -->` runs on CPU.
Blocks that are synopses (`[--flag ...]`) are fenced as `text`, not as commands."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
RUNS_MARK = "<!-- runs in tests -->"


def blocks(language: str) -> list[tuple[str, str]]:
    """(the line before the fence, the code) of every block fenced as `language`."""
    pattern = re.compile(r"(?m)^([^\n]*)\n```" + language + r"\n(.*?)^```", re.DOTALL)
    return [(m.group(1).strip(), m.group(2)) for m in pattern.finditer(README)]


def commands(code: str) -> list[str]:
    """The commands of a shell block: comments dropped, continuation lines joined."""
    joined = code.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and line[0] != "#"]


def test_ci_runs_exactly_the_readme_set_up_commands():
    set_up = next(code for _, code in blocks("bash") if "1. install" in code)
    ci = (ROOT / ".ci" / "run").read_text()
    found = commands(set_up)
    assert len(found) == 2, found
    for command in found:
        assert command in ci.splitlines(), f".ci/run does not run the README's {command!r}"


def test_every_shell_block_is_a_command_or_marked_as_a_synopsis():
    for _, code in blocks("bash"):
        for command in commands(code):
            # NOTE: brackets inside a single-quoted argument (a JSON body) are data.
            unquoted = re.sub(r"'[^']*'", "''", command.split("#")[0])
            assert "[" not in unquoted or "[dev]" in command, (
                f"a synopsis fenced as bash (fence it as text): {command}"
            )


def _run(argv: list[str], cwd: pathlib.Path, timeout: float = 300) -> str:
    done = subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, f"{argv} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_examples_run(index, tmp_path):
    _, code = blocks("python")[index]
    assert _run([sys.executable, "-c", code], tmp_path).strip(), "the example printed nothing"


MARKED = [code for before, code in blocks("bash") if before == RUNS_MARK]


def test_some_command_blocks_are_marked_to_run():
    assert MARKED, f"no block marked {RUNS_MARK}"


@pytest.mark.parametrize("index", range(len(MARKED)))
def test_marked_command_blocks_run(index, tmp_path):
    for command in commands(MARKED[index]):
        _run(["bash", "-c", command], tmp_path)
