"""What the end-to-end benchmarks share: the model they run (a checkpoint directory, or a
preset's real config with random weights written to scratch space), CUDA synchronization
around timed regions, and the transformers baseline loaded at the dtype pdserve would use.

The scripts run as `python benchmarks/NAME.py`, so they import this module as `harness`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-path", help="a model directory")
    source.add_argument("--preset", help="a named config with random weights (llama-3.2-1b, ...)")


def model_directory(args: argparse.Namespace, scratch: str | Path) -> str:
    """`--model-path` as given, or the `--preset` written with random weights under `scratch`."""
    if args.model_path is not None:
        return args.model_path
    from pdserve.synthetic.random_model import make_random_model

    return str(make_random_model(Path(scratch) / args.preset, args.preset))


def split_backend(name: str) -> tuple[str, str]:
    """A `--backends` entry as (engine, attention backend): `pdserve:torch` -> ("pdserve",
    "torch"), `pdserve` -> ("pdserve", "auto"), `transformers` -> ("transformers", "")."""
    engine, _, attention = name.partition(":")
    if engine == "pdserve":
        return engine, attention or "auto"
    return name, attention


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def load_transformers_model(model_path: str, dtype: str):
    """The checkpoint as a transformers model on pdserve's device and dtype for `dtype`
    ("auto": float32 on CPU, the checkpoint's half type on GPU), EOS disabled so that
    `generate` runs every sequence to its requested length."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine.checkpoint.model_config import ModelConfig
    from pdserve.engine.runtime.loader import resolve_device, resolve_dtype

    device = resolve_device("auto")
    torch_dtype = resolve_dtype(dtype, device, ModelConfig.from_pretrained(model_path))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    return model
