"""Start-up: an engine's parts, built in the order they need each other.

1. `load_target(config)`: the model files, the device and dtype, the tokenizer, the attention
   backend, the other tensor-parallel ranks (started now, loading their shares beside this
   process) and the target model.
2. The speculator, if any, loads its draft beside the target (`Speculator.load(engine)`: the
   draft reads the target from the engine, so `Engine` runs this step itself).
3. `build_runtime(...)`: the KV pool, sized with the draft's pools beside it, then what runs
   on it: the page allocator and prefix cache, the scheduler, the device page table, the
   CUDA graphs and the model runner.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from pdserve.engine.checkpoint.model_config import ModelConfig
from pdserve.engine.checkpoint.model_files import resolve_model_dir
from pdserve.engine.core.config import EngineConfig
from pdserve.engine.core.page_allocator import PageAllocator, pages_needed
from pdserve.engine.core.prefix_cache import PrefixCache
from pdserve.engine.core.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.parallel.tensor_parallel import ModelSplit
from pdserve.engine.ranks.rank_group import RankGroup
from pdserve.engine.runtime.attention import make_attention_backend
from pdserve.engine.runtime.cpu_threads import set_engine_threads
from pdserve.engine.runtime.decode_graphs import build_decode_graphs, graph_batch_size
from pdserve.engine.runtime.forward_batch import Capture
from pdserve.engine.runtime.kv_pool import KVPool
from pdserve.engine.runtime.loader import build_kv_pool, load_model, resolve_device, resolve_dtype
from pdserve.engine.runtime.model_runner import ModelRunner
from pdserve.engine.runtime.page_table import DevicePageTable
from pdserve.engine.runtime.sampler import Sampler
from pdserve.engine.speculator import Speculator

logger = logging.getLogger(__name__)


@dataclass
class Target:
    """The model an engine runs, loaded: all start-up knows before any KV is sized."""

    model_dir: Path
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any
    max_model_len: int
    attention_backend: Any
    ranks: RankGroup | None  # the other tensor-parallel ranks (None: one rank)
    model: torch.nn.Module


@dataclass
class Runtime:
    """What runs the target on its KV pool."""

    eos_token_ids: tuple[int, ...]
    sampler: Sampler
    max_pages_per_request: int
    capture: Capture  # target features every forward pass keeps for the draft
    kv_pool: KVPool
    allocator: PageAllocator
    prefix_cache: PrefixCache | None
    scheduler: Scheduler
    page_table: DevicePageTable
    runner: ModelRunner


def load_target(config: EngineConfig) -> Target:
    # NOTE: a hub id or GGUF file becomes a local directory here (the CLI has usually
    # resolved it already: then this is the directory itself).
    model_dir = resolve_model_dir(config.model_path)
    model_config = ModelConfig.from_pretrained(model_dir)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, model_config)
    if device.type == "cuda":
        # NOTE: cuda:N for everything this thread launches without naming a device.
        torch.cuda.set_device(device)
    # NOTE: one thread on GPU (a full OpenMP pool only contended with the server's other
    # processes: engine steps 2x slower on an H100 beside a busy HTTP front end); on CPU
    # the cores less one, split between the TP ranks (`cpu_threads`).
    set_engine_threads(device, config.cpu_threads, config.ranks_per_node)
    torch.manual_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    limit = model_config.max_position_embeddings
    max_model_len = min(config.max_model_len or limit, limit)
    attention_backend = make_attention_backend(config.attention_backend, device)
    # Tensor parallelism: this process is rank 0; the other ranks start now and load their
    # shares beside it (rank_group.py).
    ranks = None
    if config.tp_size > 1:
        split = ModelSplit.of(model_config, config.tp_size)
        ranks = RankGroup(config, model_dir, split, device, dtype)
    try:
        model = load_model(
            model_dir,
            model_config,
            device,
            dtype,
            max_model_len,
            attention_backend,
            ranks.tp if ranks else None,
        )
    except BaseException:
        if ranks is not None:
            ranks.close()  # NOTE: the other ranks do not outlive a failed start
        raise
    return Target(
        model_dir,
        model_config,
        device,
        dtype,
        tokenizer,
        max_model_len,
        attention_backend,
        ranks,
        model,
    )


def build_runtime(
    config: EngineConfig,
    target: Target,
    speculator: Speculator | None,
    transfer_slots: Callable[[int], int],
) -> Runtime:
    """`speculator`: loaded already (its draft's pools are sized beside the target's).
    `transfer_slots`: token slots of KV a handoff moves for a prompt of a given length."""
    eos_token_ids = _eos_token_ids(target)
    lookahead = speculator.lookahead_slots() if speculator else 0
    # The most pages a request can hold: max_model_len tokens and the speculative slots.
    max_pages_per_request = pages_needed(target.max_model_len + lookahead, config.page_size)
    capture = speculator.target_capture() if speculator else Capture.NONE
    if target.ranks is not None:
        target.ranks.send_plan(
            capture, speculator.verify_tokens() if speculator else 0, max_pages_per_request
        )
    kv_pool = _build_kv_pool(config, target, speculator, max_pages_per_request)
    allocator = PageAllocator(kv_pool.num_pages)
    prefix_cache = _build_prefix_cache(config, speculator, allocator)
    scheduler = Scheduler(
        SchedulerConfig(
            page_size=config.page_size,
            max_running_requests=config.max_running_requests,
            prefill_token_budget=config.prefill_token_budget,
            split_prompts=config.split_prompts,
            lookahead=lookahead,
        ),
        allocator,
        prefix_cache,
        transfer_slots=transfer_slots,
    )
    page_table = DevicePageTable(config.max_running_requests, max_pages_per_request, target.device)
    backend, device = target.attention_backend, target.device
    graph_args = (backend, target.model, kv_pool, page_table)
    decode_graphs = build_decode_graphs(config, *graph_args, device, capture=capture)
    verify_graphs = None
    if speculator is not None:
        verify_graphs = build_decode_graphs(
            config,
            *graph_args,
            device,
            capture=capture,
            tokens_per_seq=speculator.verify_tokens(),
            share_pool_with=decode_graphs,
        )
        speculator.build_graphs(
            page_table, graph_batch_size(config, backend) if decode_graphs else 0
        )
    sampler = Sampler(eos_token_ids)
    runner = ModelRunner(
        target.model,
        kv_pool,
        sampler,
        device,
        decode_graphs,
        verify_graphs,
        target.ranks,
        config.two_batch_overlap_tokens,
    )
    return Runtime(
        eos_token_ids,
        sampler,
        max_pages_per_request,
        capture,
        kv_pool,
        allocator,
        prefix_cache,
        scheduler,
        page_table,
        runner,
    )


def _eos_token_ids(target: Target) -> tuple[int, ...]:
    ids = set(target.model_config.eos_token_ids)
    if target.tokenizer.eos_token_id is not None:
        ids.add(target.tokenizer.eos_token_id)
    return tuple(sorted(ids))


def _build_kv_pool(
    config: EngineConfig,
    target: Target,
    speculator: Speculator | None,
    max_pages_per_request: int,
) -> KVPool:
    """The target's pool, sized with the draft's pools beside it: they share its page ids,
    so each page costs both."""
    pool = build_kv_pool(
        config,
        target.model_config,
        target.model,
        target.device,
        target.dtype,
        target.max_model_len,
        extra_page_bytes=speculator.draft_page_bytes() if speculator else 0,
        graph_batch=graph_batch_size(config, target.attention_backend, target.device),
        reserved_bytes=DevicePageTable.bytes_for(
            config.max_running_requests, max_pages_per_request
        ),
        tp=target.ranks.tp if target.ranks else None,
    )
    if speculator is not None:
        speculator.build_pools(pool.num_pages)
    return pool


def _build_prefix_cache(
    config: EngineConfig, speculator: Speculator | None, allocator: PageAllocator
) -> PrefixCache | None:
    if config.disable_prefix_caching:
        return None
    if speculator is not None and speculator.draft_page_bytes():
        # NOTE: a draft's KV at a page's last slot depends on the next page's first token
        # (EAGLE reads x_{i+1} at position i), so a page's draft KV is not a function of
        # its own tokens and cannot be keyed by them. Drafts without KV (NGRAM) cache.
        logger.info("prefix caching is off: the speculative draft keeps KV of its own")
        return None
    return PrefixCache(allocator, config.page_size)
