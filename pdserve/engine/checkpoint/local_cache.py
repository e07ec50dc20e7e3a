"""pdserve's own cache: where it keeps what it generates (the tiny model) or converts (GGUF
files), each entry written once and renamed into place."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def pdserve_cache_dir() -> Path:
    """Where pdserve keeps what it generates or converts: `$PDSERVE_CACHE_DIR`, else
    `~/.cache/pdserve`."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def write_cache_entry(final_dir: Path, write: Callable[[Path], object]) -> Path:
    """`final_dir`, written once by `write(staging_dir)` under a temporary name and renamed
    into place, so a reader never sees half an entry; when two processes race, both write
    and the loser discards its copy. Files are made readable by everyone sharing the cache
    (safetensors writes owner-only files)."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    staging_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.", dir=final_dir.parent))
    try:
        write(staging_dir)
        for written in staging_dir.iterdir():
            written.chmod(0o644)
        staging_dir.chmod(0o755)
        try:
            staging_dir.rename(final_dir)
        except OSError:
            if not final_dir.is_dir():
                raise
    finally:
        shutil.rmtree(staging_dir, ignore_errors=True)
    return final_dir
