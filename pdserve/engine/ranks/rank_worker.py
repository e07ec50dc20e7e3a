"""A tensor-parallel rank other than 0: its share of the model and of every KV page, and a loop
that runs each forward pass rank 0 announces (`rank_group.py` says how the ranks agree).

It schedules nothing and samples nothing. It keeps, per running request, a copy of the page
list (rank 0 sends what changed) and the request's row in its own device page table, so CUDA
graphs replay here as on rank 0. It leaves when rank 0 says so, when rank 0's store goes away
(rank 0 died; a watching thread notices within a second, even mid-collective), or on any
error (rank 0 then finds it dead and fails its requests).

Run by rank 0: `python -m pdserve.engine.ranks.rank_worker --rank R --size N --store HOST:PORT
--device DEV --config JSON`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
import zmq

from pdserve.engine.checkpoint.model_config import ModelConfig
from pdserve.engine.core.config import EngineConfig
from pdserve.engine.core.request import RequestStatus
from pdserve.engine.parallel.tensor_parallel import ModelSplit, TensorParallel, join_group
from pdserve.engine.ranks.rank_group import (
    COLLECTIVE_TIMEOUT_S,
    START_TIMEOUT_S,
    STORE_PREFIX,
    custom_all_reduce,
)
from pdserve.engine.ranks.tensor_parallel_kv import PageIdError, gather_heads, scatter_heads
from pdserve.engine.runtime.attention import make_attention_backend
from pdserve.engine.runtime.cpu_threads import set_engine_threads
from pdserve.engine.runtime.decode_graphs import build_decode_graphs, graph_batch_size
from pdserve.engine.runtime.forward_batch import Capture, ForwardBatch, ForwardOutput
from pdserve.engine.runtime.loader import build_kv_pool, load_model, resolve_dtype
from pdserve.engine.runtime.model_runner import ModelRunner
from pdserve.engine.runtime.page_table import DevicePageTable
from pdserve.protocol.channel import Channel
from pdserve.protocol.rank_messages import (
    RankForward,
    RankGatherKV,
    RankLogits,
    RankMoveKV,
    RankPlan,
    RankScatterKV,
    RankStop,
    split,
)

logger = logging.getLogger(__name__)

IDLE_CHECK_MS = 1000  # how often an idle rank checks that rank 0 still lives
RANK_MESSAGES = (
    RankPlan,
    RankForward,
    RankLogits,
    RankMoveKV,
    RankGatherKV,
    RankScatterKV,
    RankStop,
)


class RankProtocolError(RuntimeError):
    """Rank 0 sent something this rank cannot follow (a bug, never a client's doing)."""


@dataclass
class MirroredRequest:
    """What the device page table reads of a request: its pages and its table row."""

    request_id: str
    pages: list[int] = field(default_factory=list)
    pages_changed_from: int = 0
    page_table_row: Any = None
    status: RequestStatus = RequestStatus.RUNNING


class RankExtension(Protocol):
    """More messages a rank follows (a disaggregated role's KV links): built from the ready
    rank (`RankExtension(worker)`), it handles the `messages` types on the rank's loop, in
    order with the passes."""

    messages: tuple[type, ...]

    def __init__(self, worker: RankWorker) -> None: ...

    def handle(self, msg) -> None: ...


class RankWorker:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        tp: TensorParallel,
        inbox: Channel,
        extension: type[RankExtension] | None = None,
    ):
        self.config = config
        self.tp = tp
        self.inbox = inbox
        self.device = tp.device
        self.model_config = model_config
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config)
        torch.manual_seed(config.seed)
        self.backend = make_attention_backend(config.attention_backend, self.device)
        self.model = load_model(
            config.model_path,
            self.model_config,
            self.device,
            self.dtype,
            self.max_model_len,
            self.backend,
            tp,
        )
        plan = self._receive(RankPlan, deadline_s=START_TIMEOUT_S)
        self.kv_pool = build_kv_pool(
            config,
            self.model_config,
            self.model,
            self.device,
            self.dtype,
            self.max_model_len,
            graph_batch=graph_batch_size(config, self.backend, self.device),
            reserved_bytes=DevicePageTable.bytes_for(
                config.max_running_requests, plan.max_pages_per_request
            ),
            tp=tp,
        )
        self.page_table = DevicePageTable(
            config.max_running_requests, plan.max_pages_per_request, self.device
        )
        capture = Capture(plan.capture_kind, tuple(plan.capture_layers))
        graph_args = (self.backend, self.model, self.kv_pool, self.page_table, self.device)
        decode_graphs = build_decode_graphs(config, *graph_args, capture=capture)
        verify_graphs = None
        if plan.verify_tokens:
            verify_graphs = build_decode_graphs(
                config,
                *graph_args,
                capture=capture,
                tokens_per_seq=plan.verify_tokens,
                share_pool_with=decode_graphs,
            )
        self.runner = ModelRunner(
            self.model,
            self.kv_pool,
            None,
            self.device,
            decode_graphs,
            verify_graphs,
            two_batch_min_tokens=config.two_batch_overlap_tokens,
        )
        self.requests: dict[str, MirroredRequest] = {}
        self.output: ForwardOutput | None = None
        self.extension = extension(self) if extension is not None else None
        logger.info(
            "rank %d ready on %s: %d KV pages of %d KV heads",
            tp.rank,
            self.device,
            self.kv_pool.num_pages,
            self.kv_pool.num_kv_heads,
        )

    def run(self) -> None:
        while True:
            msg = self._receive(None, deadline_s=None)
            if isinstance(msg, RankStop):
                return
            if isinstance(msg, RankForward):
                self.output = self._forward(msg)
            elif isinstance(msg, RankLogits):
                self._logits(msg)
            elif isinstance(msg, RankMoveKV):
                self.runner.move_kv(msg.src, msg.dst)
            elif isinstance(msg, RankGatherKV | RankScatterKV):
                self._move_pages(msg)
            elif self.extension is not None and isinstance(msg, self.extension.messages):
                self.extension.handle(msg)
            else:
                raise RankProtocolError(f"unexpected {type(msg).__name__} after start-up")

    def _receive(self, expected: type | None, deadline_s: float | None):
        """The next message from rank 0 (of type `expected`); `watch_rank0` ends the process
        if rank 0 goes away meanwhile."""
        started = time.monotonic()
        while not self.inbox.socket.poll(IDLE_CHECK_MS):
            if deadline_s is not None and time.monotonic() - started > deadline_s:
                raise RankProtocolError(f"no message from rank 0 within {deadline_s:.0f} s")
        msg = self.inbox.receive().msg
        if expected is not None and not isinstance(msg, expected):
            raise RankProtocolError(f"expected {expected.__name__}, got {type(msg).__name__}")
        return msg

    @torch.inference_mode()
    def _forward(self, msg: RankForward) -> ForwardOutput:
        for request_id in msg.ended:
            request = self.requests.pop(request_id, None)
            if request is not None:
                request.status = RequestStatus.FINISHED  # NOTE: frees its page-table row
        batch = ForwardBatch()
        masks = {m.seq: m for m in msg.masks}
        num_pages = self.kv_pool.num_pages
        count = len(msg.request_ids)
        per_sequence = (msg.pages_kept, msg.num_computed, msg.new_page_counts, msg.token_counts)
        if any(len(values) != count for values in (*per_sequence, msg.position_counts)):
            raise RankProtocolError(f"a pass of {count} sequences with other-length lists")
        try:
            all_new_pages = split(msg.new_pages, msg.new_page_counts, "new_pages")
            all_tokens = split(msg.token_ids, msg.token_counts, "token_ids")
            all_positions = split(msg.positions, msg.position_counts, "positions")
        except ValueError as error:
            raise RankProtocolError(str(error)) from None
        for seq, request_id in enumerate(msg.request_ids):
            new_pages = all_new_pages[seq]
            if any(not 0 <= page < num_pages for page in new_pages):
                raise RankProtocolError(f"page ids outside [0, {num_pages}) for {request_id!r}")
            request = None
            pages = list(new_pages)
            if request_id:
                request = self.requests.setdefault(request_id, MirroredRequest(request_id))
                kept = msg.pages_kept[seq]
                if kept > len(request.pages):
                    raise RankProtocolError(
                        f"{request_id!r} keeps {kept} pages; this rank knows {len(request.pages)}"
                    )
                del request.pages[kept:]
                request.pages.extend(new_pages)
                request.pages_changed_from = min(request.pages_changed_from, kept)
                pages = request.pages
            mask = masks.get(seq)
            batch.add(
                pages,
                msg.num_computed[seq],
                all_tokens[seq],
                all_positions[seq] or None,
                None if mask is None else _mask_tensor(mask),
                request=request,
            )
        device_tokens = None
        if msg.device_tokens_shape:
            dtype = getattr(torch, msg.device_tokens_dtype)
            device_tokens = torch.empty(msg.device_tokens_shape, dtype=dtype, device=self.device)
            self.tp.broadcast_from_first(device_tokens)
        capture = Capture(msg.capture_kind, tuple(msg.capture_layers))
        return self.runner.forward(batch, capture, device_tokens, graphs=msg.graphs)

    @torch.inference_mode()
    def _move_pages(self, msg: RankGatherKV | RankScatterKV) -> None:
        """This rank's part of a handoff's gather (prefill) or commit (decode)."""
        try:
            if isinstance(msg, RankGatherKV):
                gather_heads(self.tp, self.kv_pool, msg.pages)
            else:
                scatter_heads(self.tp, self.kv_pool, msg.pages, None)
        except PageIdError as error:
            raise RankProtocolError(str(error)) from None

    @torch.inference_mode()
    def _logits(self, msg: RankLogits) -> None:
        if self.output is None:
            raise RankProtocolError("logits asked for before any forward pass")
        self.runner.compute_logits(self.output, msg.rows)


def _mask_tensor(mask) -> torch.Tensor:
    if len(mask.visible) != mask.rows * mask.width:
        raise RankProtocolError(f"a mask of {len(mask.visible)} for [{mask.rows}, {mask.width}]")
    return torch.tensor(mask.visible, dtype=torch.bool).view(mask.rows, mask.width)


def config_from_json(text: str) -> EngineConfig:
    """Rank 0's settings as it sends them (without speculative ones: drafts run on rank 0)."""
    return EngineConfig(**json.loads(text))


def watch_rank0(host: str, port: int, size: int, rank: int) -> None:
    """End this process once rank 0's store stops answering (rank 0 died), wherever the main
    thread is: waiting for a message, or inside a collective that NCCL would otherwise wait
    on until its timeout. A connection of its own: store clients are not shared by threads."""
    store = dist.TCPStore(
        host, port, size, is_master=False, timeout=datetime.timedelta(seconds=START_TIMEOUT_S)
    )
    while True:
        time.sleep(IDLE_CHECK_MS / 1000)
        try:
            store.check([f"{STORE_PREFIX}/alive"])
        except dist.DistNetworkError:
            logger.info("rank 0 is gone; rank %d leaves", rank)
            os._exit(0)


def main(argv: list[str] | None = None, extension: type[RankExtension] | None = None) -> int:
    """`extension`: more messages this rank follows (`RankExtension`)."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.engine.ranks.rank_worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--store", required=True, help="HOST:PORT of rank 0's TCPStore")
    parser.add_argument("--device", required=True)
    parser.add_argument("--config", required=True, help="the EngineConfig as JSON")
    args = parser.parse_args(argv)
    level = os.environ.get("PDSERVE_LOG_LEVEL", "info").upper()
    logging.basicConfig(level=level, format=f"%(levelname)s rank {args.rank}: %(message)s")
    config = config_from_json(args.config)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    set_engine_threads(device, config.cpu_threads, config.ranks_per_node)
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(
        host,
        int(port),
        args.size,
        is_master=False,
        timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
    )
    extra = extension.messages if extension is not None else ()
    inbox = Channel(zmq.Context(), zmq.PULL, accepts=RANK_MESSAGES + extra)
    inbox.connect(store.get(f"{STORE_PREFIX}/steps/{args.rank}").decode())
    store.set(f"{STORE_PREFIX}/joined/{args.rank}", "1")
    model_config = ModelConfig.from_pretrained(config.model_path)
    tp = join_group(
        ModelSplit.of(model_config, args.size),
        args.rank,
        dist.PrefixStore(STORE_PREFIX, store),
        device,
        resolve_dtype(config.dtype, device, model_config),
        timeout_s=COLLECTIVE_TIMEOUT_S,
        custom_all_reduce=custom_all_reduce(config),
    )
    threading.Thread(
        target=watch_rank0, args=(host, int(port), args.size, args.rank), daemon=True
    ).start()
    try:
        RankWorker(config, model_config, tp, inbox, extension).run()
    except Exception:
        logger.exception("rank %d failed", args.rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
