"""GGUF files as model directories, dequantized once through transformers' GGUF support.

A `.gguf` file (llama.cpp's format) holds the config, the tokenizer with its chat template,
and quantized weights. pdserve runs dense weights, so a GGUF file is dequantized to float32
(what transformers computes with) and written into pdserve's cache as an ordinary model
directory: `config.json`, `generation_config.json`, the tokenizer's files and safetensors
shards. Every process of a cluster then loads that directory as it loads any other, and a
second start skips the conversion.

- The cache entry is keyed by the file's absolute path, size and modification time: a file
  changed in place converts again.
- Before the slow part, the file is checked: its architecture must be one pdserve runs and
  every quantization type in it must be one the `gguf` package can dequantize; otherwise the
  error names the type and a tensor that has it.
- The directory is written under a temporary name and renamed into place, so a reader never
  sees half a conversion; two processes converting at once both finish and one copy wins.
- The whole model is dequantized in host memory (4 bytes per parameter), and the directory
  takes as much disk.
"""

from __future__ import annotations

import hashlib
import logging
from importlib.metadata import version
from pathlib import Path

import torch

from pdserve.engine.checkpoint.local_cache import pdserve_cache_dir, write_cache_entry
from pdserve.engine.checkpoint.model_config import UnsupportedModelError

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> the Hugging Face architecture pdserve runs it as
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# NOTE: bump when the files a conversion writes change, so cached conversions are redone.
CONVERSION_VERSION = "2"
MAX_SHARD_SIZE = "4GB"


class GGUFError(ValueError):
    """A GGUF file pdserve cannot read or dequantize."""


def gguf_model_dir(gguf_file: Path) -> Path:
    """The model directory converted from `gguf_file`, converting it on first use."""
    gguf_file = gguf_file.resolve()
    final_dir = _cache_entry(gguf_file)
    if (final_dir / "config.json").is_file():
        return final_dir
    check_gguf(gguf_file)
    logger.info("dequantizing %s into %s (once)", gguf_file, final_dir)
    return write_cache_entry(final_dir, lambda staging_dir: _convert(gguf_file, staging_dir))


def _cache_entry(gguf_file: Path) -> Path:
    stat = gguf_file.stat()
    key = f"{gguf_file}|{stat.st_size}|{stat.st_mtime_ns}|v{CONVERSION_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return pdserve_cache_dir() / "gguf" / f"{gguf_file.stem}-{digest}"


def check_gguf(gguf_file: Path) -> str:
    """The file's architecture, after checking that pdserve can run it and that every
    quantization type in it dequantizes (one tensor of each type is tried)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(gguf_file)
    except (ValueError, OSError, IndexError) as e:
        # NOTE: a damaged file fails deep in the reader: a value read past the end of its
        # section (IndexError), a size that does not divide (ValueError).
        raise GGUFError(f"{gguf_file} is not a readable GGUF file: {e}") from None
    architecture = _string_field(reader, "general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gguf_file}: GGUF architecture {architecture!r} is not supported; supported: "
            + ", ".join(GGUF_ARCHITECTURES)
        )
    smallest_of_type = {}
    for tensor in reader.tensors:
        known = smallest_of_type.get(tensor.tensor_type)
        if known is None or tensor.n_elements < known.n_elements:
            smallest_of_type[tensor.tensor_type] = tensor
    for quant_type, tensor in smallest_of_type.items():
        try:
            dequantize(tensor.data, quant_type)
        except NotImplementedError:
            raise GGUFError(
                f"{gguf_file}: tensor {tensor.name} is quantized as {quant_type.name}, which "
                f"the installed gguf package ({version('gguf')}) cannot dequantize"
            ) from None
    return architecture


def _string_field(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def _convert(gguf_file: Path, out_dir: Path) -> None:
    """Config, generation config, tokenizer and float32 weights of `gguf_file`, written to
    `out_dir` as a Hugging Face model directory."""
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    source = {"pretrained_model_name_or_path": gguf_file.parent, "gguf_file": gguf_file.name}
    config = AutoConfig.from_pretrained(**source)
    config.architectures = [GGUF_ARCHITECTURES[config.model_type]]
    config.dtype = "float32"
    # NOTE: transformers names GGUF tensors by matching them to a model's parameters; an
    # empty (meta) model gives it the names without allocating anything.
    with torch.device("meta"):
        names_only = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=names_only)[
        "tensors"
    ]
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(**source).save_pretrained(out_dir)
    save_torch_state_dict(
        {name: tensor.contiguous() for name, tensor in tensors.items()},
        out_dir,
        max_shard_size=MAX_SHARD_SIZE,
    )
