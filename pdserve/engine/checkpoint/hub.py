"""Hugging Face hub ids as local directories, through `huggingface_hub`'s cache.

The cache is looked at first, so a cached model starts without touching the network; a model
not cached is downloaded (with huggingface_hub's progress bars) unless the hub is offline
(`HF_HUB_OFFLINE=1`, or no connection), in which case the error says which id and revision
it looked for and in which cache. Only the files pdserve reads are fetched: configs, the
tokenizer and safetensors weights (never `.bin` pickles or GGUF variants).
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from pdserve.engine.checkpoint.errors import ModelNotFoundError

# configs, tokenizer (tokenizer.json, vocab/merges, sentencepiece), chat templates, weights
MODEL_FILE_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def is_hub_id(name: str) -> bool:
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_model_dir(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of `repo_id` at `revision` (default branch when None)."""
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        return _snapshot(repo_id, revision, local_files_only=True)
    except LocalEntryNotFoundError:
        pass  # not cached (or cached incompletely): download it
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(
            f"model {where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            "the hub is offline (HF_HUB_OFFLINE=1): download it where the hub is reachable, "
            "or pass a local model directory"
        )
    try:
        return _snapshot(repo_id, revision, local_files_only=False)
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise ModelNotFoundError(
            f"model {where}: the hub has no such model, or it is gated or private "
            f"(log in or set HF_TOKEN): {type(e).__name__}"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"model {repo_id!r} has no revision {revision!r}") from None
    except (LocalEntryNotFoundError, OSError) as e:
        raise ModelNotFoundError(
            f"model {where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"could not be downloaded: {str(e).splitlines()[0]}"
        ) from None


def _snapshot(repo_id: str, revision: str | None, *, local_files_only: bool) -> Path:
    path = Path(
        snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=MODEL_FILE_PATTERNS,
            local_files_only=local_files_only,
        )
    )
    if local_files_only and not (
        (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    ):
        # NOTE: a snapshot some other tool cached in part; fetch what pdserve needs.
        raise LocalEntryNotFoundError(f"{path} has no config.json or no safetensors weights")
    return path
