"""Reading HF safetensors checkpoints (single file or sharded with an index), with progress.

Tensors are opened straight onto the target device, one at a time, so peak host memory stays
at one tensor regardless of model size.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

logger = logging.getLogger(__name__)


def checkpoint_files(model_path: str | Path) -> list[Path]:
    path = Path(model_path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def iterate_weights(
    model_path: str | Path, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, showing progress: a bar on a
    terminal, a log line per shard otherwise."""
    files = checkpoint_files(model_path)
    bar = (
        tqdm(total=len(files), desc="Loading weights", unit="shard")
        if sys.stderr.isatty()
        else None
    )
    started = time.monotonic()
    for number, file in enumerate(files, start=1):
        with safe_open(file, framework="pt", device=str(device)) as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, shard.get_tensor(name)
        if bar is not None:
            bar.update(1)
        elif len(files) > 1:
            logger.info(
                "loaded shard %d/%d (%s) after %.1f s",
                number,
                len(files),
                file.name,
                time.monotonic() - started,
            )
    if bar is not None:
        bar.close()
