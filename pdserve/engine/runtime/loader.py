"""Start-up: pick device and dtype, build and load the model, size the KV pool."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from pdserve.engine.checkpoint.dtypes import parse_dtype
from pdserve.engine.checkpoint.model_config import ModelConfig
from pdserve.engine.checkpoint.weights import iterate_weights
from pdserve.engine.core.config import EngineConfig
from pdserve.engine.core.page_allocator import pages_needed
from pdserve.engine.parallel.tensor_parallel import TensorParallel
from pdserve.engine.runtime.attention import AttentionBackend, AttentionContext
from pdserve.engine.runtime.kv_pool import KVPool
from pdserve.engine.runtime.models import CausalLM, model_class

logger = logging.getLogger(__name__)


class KVCacheTooSmallError(RuntimeError):
    """The memory left for the KV cache cannot hold even one full-length sequence."""


def resolve_device(name: str) -> torch.device:
    """A torch device; CUDA always with its index ("cuda" is the current device)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but CUDA is not available")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, device: torch.device, model_config: ModelConfig) -> torch.dtype:
    """'auto' is float32 on CPU, and on GPU the checkpoint's half type (bfloat16 if none)."""
    if name != "auto":
        return parse_dtype(name)
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if model_config.torch_dtype == "float16" else torch.bfloat16


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_dir: str | Path,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    backend: AttentionBackend,
    tp: TensorParallel | None = None,
) -> CausalLM:
    """The model, or with `tp` this rank's share of it (only its slices are read)."""
    cls = model_class(model_config.architecture)
    with torch.device(device), default_dtype(dtype):
        model = cls(model_config, backend, max_positions, tp)
    model.load_weights(iterate_weights(model_dir, device, lazy=tp is not None))
    return model.eval()


def build_kv_pool(
    config: EngineConfig,
    model_config: ModelConfig,
    model: CausalLM,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    extra_page_bytes: int = 0,
    *,
    graph_batch: int = 0,
    reserved_bytes: int = 0,
    tp: TensorParallel | None = None,
) -> KVPool:
    """The target's KV pool. `extra_page_bytes`: bytes per page of other pools that share
    its page ids (a draft model's), counted against the same budget. On a GPU, the budget
    also leaves room for CUDA graphs of decode batches up to `graph_batch` (0: none) and for
    `reserved_bytes` of other device buffers. With `tp`, the pool of this rank's KV heads,
    with as many pages as every rank can hold (page ids are the same on every rank)."""
    kv_heads = model_config.num_kv_heads if tp is None else tp.split.kv_heads_per_rank
    target_page_bytes = KVPool.bytes_per_page(
        model_config.num_layers, config.page_size, kv_heads, model_config.head_dim, dtype
    )
    page_bytes = target_page_bytes + extra_page_bytes
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif device.type == "cuda":
        budget = _gpu_kv_budget(
            config, model_config, model, device, dtype, max_model_len, graph_batch, kv_heads
        )
        budget = max(budget - reserved_bytes, 0)
    else:
        full = config.max_running_requests * pages_needed(max_model_len, config.page_size)
        budget = min(full * page_bytes, config.cpu_kv_cache_cap)
    num_pages = budget // page_bytes
    if tp is not None:
        num_pages = tp.all_reduce_min(num_pages)
    if num_pages * config.page_size < max_model_len:
        raise KVCacheTooSmallError(
            f"{budget / 2**20:.1f} MiB of KV cache holds {num_pages * config.page_size} tokens, "
            f"less than one sequence of max_model_len={max_model_len}; give it more memory "
            "(--kv-cache-memory / --gpu-memory-utilization) or lower --max-model-len"
        )
    return KVPool(
        num_layers=model_config.num_layers,
        num_pages=num_pages,
        page_size=config.page_size,
        num_kv_heads=kv_heads,
        head_dim=model_config.head_dim,
        dtype=dtype,
        device=device,
    )


def _gpu_kv_budget(
    config, model_config, model, device, dtype, max_model_len, graph_batch: int, kv_heads: int
) -> int:
    """What is left of `gpu_memory_utilization` x total memory after the weights, the peak
    activations of the largest prefill step and, with CUDA graphs, the activations of the
    largest captured decode batch (which a graph's memory pool keeps for good); both measured
    with one dummy forward pass."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    tokens = min(config.prefill_token_budget, max_model_len)
    probe = KVPool(
        num_layers=model_config.num_layers,
        num_pages=pages_needed(tokens, config.page_size),
        page_size=config.page_size,
        num_kv_heads=kv_heads,
        head_dim=model_config.head_dim,
        dtype=dtype,
        device=device,
    )
    ctx = AttentionContext.build(
        page_size=config.page_size,
        pages=[list(range(probe.num_pages))],
        num_computed=[0],
        query_lens=[tokens],
        device=device,
    )
    ids = torch.zeros(tokens, dtype=torch.int64, device=device)
    with torch.inference_mode():
        hidden = model(ids, ctx.positions, probe, ctx)
        model.compute_logits(hidden[-config.max_running_requests :])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - probe.nbytes
    del ctx, hidden
    graphs = _decode_activation_bytes(model, probe, graph_batch) if graph_batch else 0
    del probe
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    budget = int(total * config.gpu_memory_utilization) - peak - graphs
    logger.info(
        "GPU memory: total %.1f GiB, weights+activations peak %.1f GiB, CUDA graphs %.2f GiB, "
        "KV budget %.1f GiB",
        total / 2**30,
        peak / 2**30,
        graphs / 2**30,
        budget / 2**30,
    )
    return max(budget, 0)


def _decode_activation_bytes(model: CausalLM, probe: KVPool, batch: int) -> int:
    """Peak memory a decode forward of `batch` sequences allocates (over what is already
    allocated): about what the memory pool of its CUDA graph keeps."""
    device = probe.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ctx = AttentionContext.build(
        page_size=probe.page_size,
        pages=[[i % probe.num_pages] for i in range(batch)],
        num_computed=[0] * batch,
        query_lens=[1] * batch,
        device=device,
    )
    ids = torch.zeros(batch, dtype=torch.int64, device=device)
    with torch.inference_mode():
        model(ids, ctx.positions, probe, ctx)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
