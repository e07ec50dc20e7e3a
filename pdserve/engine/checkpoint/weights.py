"""Reading HF safetensors checkpoints (single file or sharded with an index), with progress.

Tensors are opened straight onto the target device, one at a time, so peak host memory stays
at one tensor regardless of model size. A tensor-parallel rank reads tensors lazily
(`CheckpointTensor`): only the slice it owns leaves the file.
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


class CheckpointTensor:
    """A checkpoint tensor not read yet: `narrow` picks a slice, `read` loads just that."""

    def __init__(self, lazy, device: torch.device, index: tuple[slice, ...] | None = None):
        self._lazy = lazy  # NOTE: a safetensors slice; it reads only what it is indexed with
        self._device = device
        shape = tuple(lazy.get_shape())
        self._index = index or tuple(slice(0, n) for n in shape)
        self.shape = tuple(s.stop - s.start for s in self._index)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(
                f"slice [{start}, {start + length}) of a dimension of {self.shape[dim]}"
            )
        index = list(self._index)
        first = index[dim].start + start
        index[dim] = slice(first, first + length)
        return CheckpointTensor(self._lazy, self._device, tuple(index))

    def read(self) -> torch.Tensor:
        return self._lazy[self._index].to(self._device)


def iterate_weights(
    model_path: str | Path, device: torch.device, *, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | CheckpointTensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, showing progress: a bar on a
    terminal, a log line per shard otherwise. `lazy`: `CheckpointTensor`s instead, read when
    (and as far as) the loader asks."""
    files = checkpoint_files(model_path)
    bar = (
        tqdm(total=len(files), desc="Loading weights", unit="shard")
        if sys.stderr.isatty()
        else None
    )
    started = time.monotonic()
    for number, file in enumerate(files, start=1):
        with safe_open(file, framework="pt", device="cpu" if lazy else str(device)) as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open has no __iter__
                if lazy:
                    yield name, CheckpointTensor(shard.get_slice(name), device)
                else:
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


def read_tensor(model_path: str | Path, name: str, device: torch.device) -> torch.Tensor:
    """One tensor of the checkpoint, whole."""
    for file in checkpoint_files(model_path):
        with safe_open(file, framework="pt", device=str(device)) as shard:
            if name in shard.keys():  # noqa: SIM118 - safe_open has no __contains__
                return shard.get_tensor(name)
    raise KeyError(f"the checkpoint at {model_path} has no tensor {name!r}")
