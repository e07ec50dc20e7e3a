"""Models named as users name them, resolved to one local directory.

vLLM and SGLang take a model as a local directory, a Hugging Face hub id
(`Qwen/Qwen2.5-0.5B-Instruct`) or a GGUF file; so does pdserve. Whatever the name, the rest
of the engine sees one thing: a directory with `config.json`, the tokenizer's files and
safetensors weights. A hub id resolves to its snapshot in the Hugging Face cache (`hub.py`),
a GGUF file to a directory dequantized once into pdserve's cache (`gguf_import.py`).
Resolving is idempotent: a resolved directory resolves to itself, so the launcher resolves
once (downloading or converting there) and hands its workers the directory.
"""

from __future__ import annotations

from pathlib import Path

from pdserve.engine.checkpoint.errors import ModelNotFoundError

GGUF_SUFFIX = ".gguf"


def resolve_model_dir(name: str, revision: str | None = None) -> Path:
    """The local model directory for `name`: a directory as is, a `.gguf` file dequantized
    into the cache (once), or a hub id at `revision` (a branch, tag or commit; the default
    branch when None) from the Hugging Face cache, downloaded when not cached and online."""
    path = Path(name).expanduser()
    if path.exists():
        if revision is not None:
            raise ModelNotFoundError(
                f"--revision {revision!r} applies to Hugging Face hub ids; {name!r} is a local "
                f"{'directory' if path.is_dir() else 'file'}"
            )
        if path.is_dir():
            return path
        if path.suffix.lower() == GGUF_SUFFIX:
            from pdserve.engine.checkpoint.gguf_import import gguf_model_dir

            return gguf_model_dir(path)
        raise ModelNotFoundError(
            f"model {name!r} is a file but not a {GGUF_SUFFIX} file: pass a model directory, "
            "a GGUF file or a Hugging Face hub id"
        )
    if path.suffix.lower() == GGUF_SUFFIX:
        raise ModelNotFoundError(f"GGUF file {name!r} does not exist")
    from pdserve.engine.checkpoint.hub import hub_model_dir, is_hub_id

    if not is_hub_id(name):
        raise ModelNotFoundError(
            f"model {name!r} does not exist: it is not a local directory or {GGUF_SUFFIX} "
            "file, nor a Hugging Face hub id (org/name)"
        )
    return hub_model_dir(name, revision)


def refuse_remote_code() -> None:
    """`--trust-remote-code` is refused: pdserve runs its own implementation of each
    supported architecture, never code shipped with a checkpoint."""
    from pdserve.engine.checkpoint.model_config import SUPPORTED_ARCHITECTURES

    raise ValueError(
        "--trust-remote-code is refused: pdserve never runs code shipped with a checkpoint; "
        "it runs its own implementation of " + ", ".join(SUPPORTED_ARCHITECTURES)
    )
