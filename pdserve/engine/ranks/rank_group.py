"""Rank 0 of a tensor-parallel worker: it starts the other ranks and keeps them in lock-step.

The engine (scheduler, sampler, speculator, handoffs) runs on rank 0 alone. Every rank holds
its share of the weights and of every KV page (`tensor_parallel.py`) and runs every forward
pass of the target; page ids are the same on every rank, so rank 0's allocator and prefix
cache serve them all. Before each pass, `ModelRunner` calls `forward` here: one
`RankForward` message per rank over ZMQ (msgpack, as every engine message), then, if the
pass reads tokens that are still on the device, a broadcast of them. Logits (`logits`) and
KV moves of accepted tree drafts (`move_kv`) are mirrored the same way. Collectives then
keep the ranks together inside the pass.

The other ranks are processes of their own (`python -m pdserve.engine.ranks.rank_worker`), found
through a TCPStore that rank 0 hosts: they register there, read where rank 0 sends their
messages, and leave when the store goes away (rank 0 died). Rank 0 starts the ranks of its
own node; with `--nnodes` > 1 each other node's `pdserve serve --node-rank K` starts its own
(`node_ranks.py`), with rank 0's settings from the store, and posts there when one of them
exits. Rank 0 checks that its ranks still live before each pass (its own processes every
time, the store's word on other nodes' once a second), so a dead rank fails the pass (and
the requests in it) at once instead of hanging in a collective.

The store and the message channels are not authenticated (nor is torch.distributed's
store): a worker that spans nodes belongs on a private network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
import zmq

from pdserve.engine.core.config import EngineConfig
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.parallel.tensor_parallel import (
    ModelSplit,
    TensorParallelError,
    join_group,
)
from pdserve.engine.runtime.forward_batch import Capture, ForwardBatch
from pdserve.protocol.channel import Channel
from pdserve.protocol.rank_messages import (
    RankForward,
    RankGatherKV,
    RankLogits,
    RankMask,
    RankMoveKV,
    RankPlan,
    RankScatterKV,
    RankStop,
    flatten,
)

logger = logging.getLogger(__name__)

STORE_PREFIX = "pdserve-tp"
START_TIMEOUT_S = 600.0  # the slowest rank's start: imports, weights, CUDA graphs
COLLECTIVE_TIMEOUT_S = 300.0  # a collective no rank joins fails after this
SEND_TIMEOUT_MS = 10_000
STOP_WAIT_S = 10.0
POLL_S = 0.05
REMOTE_CHECK_S = 1.0
WATCH_INTERVAL_S = 0.2
# A worker stuck this long after one of its ranks died gives up (`RankGroup.watch`).
RANK_DEATH_GRACE_S = 5.0
DEAD_KEY = f"{STORE_PREFIX}/dead"  # set by another node when one of its ranks exits
CONFIG_KEY = f"{STORE_PREFIX}/config"  # rank 0's engine settings, for the other nodes


class RankDiedError(RuntimeError):
    """Another rank of this tensor-parallel worker exited: the worker cannot step any more."""


def rank_device(device: torch.device, local_index: int) -> torch.device:
    """The device of a node's `local_index`-th rank: the GPUs after the node's first, or the
    CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + local_index)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class RankGroup:
    """The other ranks of this worker, seen from rank 0."""

    def __init__(
        self, config: EngineConfig, model_dir: str, split: ModelSplit, device, dtype: torch.dtype
    ):
        self.split = split
        size = split.size
        local = config.ranks_per_node
        if device.type == "cuda" and (device.index or 0) + local > torch.cuda.device_count():
            raise TensorParallelError(
                f"{local} tensor-parallel ranks on this node from {device} need GPUs up to "
                f"cuda:{(device.index or 0) + local - 1}; it has {torch.cuda.device_count()}"
            )
        if config.nnodes > 1:
            host, port = split_address(config.dist_init_addr)
            bind = f"tcp://{socket.gethostbyname(host)}"
        else:
            host, port, bind = "127.0.0.1", 0, "tcp://127.0.0.1"
        self.store = dist.TCPStore(
            host,
            port,
            size,
            is_master=True,
            timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
            wait_for_workers=False,
        )
        self._broken: str | None = None
        self._closing = threading.Event()
        self.context = zmq.Context()
        self.channels: list[Channel] = []
        self.processes: list[subprocess.Popen] = []
        self._finalizer = weakref.finalize(self, stop_processes, self.processes, 0.0)
        try:
            self._start(config, model_dir, device, dtype, host, bind)
        except BaseException:
            self.close(ask=False)  # NOTE: no rank or socket outlives a failed start
            raise
        # Requests whose pages the other ranks mirror, to tell them when each stops running.
        self._mirrored: dict[str, Request] = {}

    def _start(self, config: EngineConfig, model_dir: str, device, dtype, host, bind) -> None:
        size, local = self.split.size, config.ranks_per_node
        worker_config = dataclasses.replace(config, model_path=str(model_dir), speculative=None)
        self.store.set(CONFIG_KEY, json.dumps(dataclasses.asdict(worker_config)))
        for rank in range(1, size):
            channel = Channel(self.context, zmq.PUSH, send_timeout_ms=SEND_TIMEOUT_MS)
            channel_port = channel.bind_random_port(bind)
            self.store.set(f"{STORE_PREFIX}/steps/{rank}", f"{bind}:{channel_port}")
            self.channels.append(channel)
        store_address = f"{host}:{self.store.port}"
        for rank in range(1, local):
            device_of_rank = rank_device(device, rank)
            self.processes.append(
                spawn_rank(worker_config, rank, size, store_address, device_of_rank)
            )
        self._remote = size > local
        self._last_remote_check = 0.0
        self._wait_for_ranks("joined")
        self.tp = join_group(
            self.split,
            0,
            dist.PrefixStore(STORE_PREFIX, self.store),
            device,
            dtype,
            timeout_s=COLLECTIVE_TIMEOUT_S,
            custom_all_reduce=custom_all_reduce(config),
        )

    def _wait_for_ranks(self, stage: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank in range(1, self.split.size):
            key = f"{STORE_PREFIX}/{stage}/{rank}"
            while not self.store.check([key]):
                self.check_alive(f"while starting ({stage})")
                if time.monotonic() > deadline:
                    raise TensorParallelError(
                        f"tensor-parallel rank {rank} did not start within {START_TIMEOUT_S:.0f} s"
                    )
                time.sleep(POLL_S)

    def abandon(self, reason: str) -> RankDiedError:
        """Rank 0 failed inside a mirrored call: the other ranks may wait in a collective it
        never joins, and a later pass would pair with it. Stop them; every later call fails.
        Returns the error to raise."""
        self._broken = f"the tensor-parallel ranks were stopped: {reason}"
        stop_processes(self.processes, 0.0)
        with contextlib.suppress(Exception):
            self.store.set(DEAD_KEY, self._broken)  # NOTE: other nodes' ranks leave too
        return RankDiedError(self._broken)

    def watch(
        self, on_stuck: Callable[[str], None], grace_s: float = RANK_DEATH_GRACE_S
    ) -> threading.Thread:
        """Watch this node's ranks from a thread of its own. A rank that dies inside a pass
        can block rank 0's thread for good, where `check_alive` never runs again: in a kernel
        that waits for the dead rank (the one-shot all-reduce waits on its peer's flag) or in
        an NCCL collective until its timeout (`COLLECTIVE_TIMEOUT_S`). If this group is not
        closed within `grace_s` of a rank's death, `on_stuck(reason)` runs on the watching
        thread: the engine process exits there, and its front end starts a new one. (`LLM`
        does not watch: a library does not end its caller's process.) Returns the thread,
        which ends once the group closes or `on_stuck` returns."""
        watcher = threading.Thread(
            target=self._watch, args=(on_stuck, grace_s), name="tp-rank-watch", daemon=True
        )
        watcher.start()
        return watcher

    def _watch(self, on_stuck: Callable[[str], None], grace_s: float) -> None:
        while not self._closing.wait(WATCH_INTERVAL_S):
            for rank, process in enumerate(self.processes, start=1):
                code = process.poll()
                if code is None:
                    continue
                if not self._closing.wait(grace_s):
                    on_stuck(
                        f"tensor-parallel rank {rank} exited with code {code} and rank 0 did "
                        f"not get past it within {grace_s:g} s"
                    )
                return

    def check_alive(self, when: str = "") -> None:
        if self._broken is not None:
            raise RankDiedError(self._broken)
        suffix = f" {when}" if when else ""
        for rank, process in enumerate(self.processes, start=1):
            code = process.poll()
            if code is not None:
                stop_processes(self.processes, 0.0)  # NOTE: the others wait for it in vain
                raise RankDiedError(
                    f"tensor-parallel rank {rank} exited with code {code}{suffix}; its log is above"
                )
        now = time.monotonic()
        if self._remote and now - self._last_remote_check >= REMOTE_CHECK_S:
            self._last_remote_check = now
            if self.store.check([DEAD_KEY]):
                stop_processes(self.processes, 0.0)
                raise RankDiedError(self.store.get(DEAD_KEY).decode() + suffix)

    # ---- start-up ---------------------------------------------------------------------

    def send_plan(self, capture: Capture, verify_tokens: int, max_pages_per_request: int) -> None:
        self._send(
            RankPlan(capture.kind, list(capture.layer_ids), verify_tokens, max_pages_per_request)
        )

    # ---- each pass --------------------------------------------------------------------

    def forward(
        self,
        batch: ForwardBatch,
        capture: Capture,
        graphs: str,
        device_tokens: torch.Tensor | None,
    ) -> None:
        """Tell the other ranks to run this pass (rank 0 runs it right after)."""
        self.check_alive()
        ended = [
            request_id
            for request_id, request in self._mirrored.items()
            if request.status is not RequestStatus.RUNNING
        ]
        for request_id in ended:
            del self._mirrored[request_id]
        ids, kept, new_pages = [], [], []
        for request, pages in zip(batch.requests, batch.pages, strict=True):
            if request is None:
                ids.append("")
                kept.append(0)
                new_pages.append(list(pages))
                continue
            mirrored = self._mirrored.get(request.request_id)
            keep = min(request.pages_mirrored, len(pages)) if mirrored is request else 0
            ids.append(request.request_id)
            kept.append(keep)
            new_pages.append(pages[keep:])
            request.pages_mirrored = len(pages)
            self._mirrored[request.request_id] = request
        masks = [
            RankMask(seq, *mask.shape, mask.flatten().tolist()) for seq, mask in batch.masks.items()
        ]
        new_pages, new_page_counts = flatten(new_pages)
        token_ids, token_counts = flatten(batch.token_ids)
        positions, position_counts = flatten([p or [] for p in batch.positions])
        self._send(
            RankForward(
                request_ids=ids,
                pages_kept=kept,
                new_pages=new_pages,
                new_page_counts=new_page_counts,
                num_computed=list(batch.num_computed),
                token_ids=token_ids,
                token_counts=token_counts,
                positions=positions,
                position_counts=position_counts,
                masks=masks,
                capture_kind=capture.kind,
                capture_layers=list(capture.layer_ids),
                graphs=graphs,
                device_tokens_shape=[] if device_tokens is None else list(device_tokens.shape),
                device_tokens_dtype="" if device_tokens is None else _dtype_name(device_tokens),
                ended=ended,
            )
        )
        if device_tokens is not None:
            self.tp.broadcast_from_first(device_tokens.contiguous())

    def logits(self, rows: list[int] | None) -> None:
        self._send(RankLogits(rows))

    def move_kv(self, src: list[int], dst: list[int]) -> None:
        self._send(RankMoveKV(src, dst))

    def gather_kv(self, pages: list[int]) -> None:
        """Tell the other ranks to gather their heads of `pages` to rank 0 (a handoff)."""
        self.check_alive()
        self._send(RankGatherKV(pages))

    def scatter_kv(self, pages: list[int]) -> None:
        """Tell the other ranks to take their heads of `pages` from rank 0 (a commit)."""
        self.check_alive()
        self._send(RankScatterKV(pages))

    def send_to(self, rank: int, msg) -> None:
        """One message for rank `rank` alone (a handoff's own KV move), in order with the
        passes."""
        self.check_alive()
        self._send_one(rank, msg)

    def _send(self, msg) -> None:
        for rank in range(1, len(self.channels) + 1):
            self._send_one(rank, msg)

    def _send_one(self, rank: int, msg) -> None:
        try:
            self.channels[rank - 1].send(msg)
        except zmq.Again:
            self.check_alive()
            raise RankDiedError(
                f"tensor-parallel rank {rank} took no message for {SEND_TIMEOUT_MS} ms"
            ) from None

    # ---- shutdown ---------------------------------------------------------------------

    def close(self, *, ask: bool = True) -> None:
        """Stop the other ranks (asked first, killed after `STOP_WAIT_S`; without `ask`,
        killed now)."""
        self._closing.set()  # NOTE: ranks stopped from here on are no deaths to watch for
        if ask:
            for channel in self.channels:
                # NOTE: a rank that cannot take it is killed below.
                with contextlib.suppress(zmq.ZMQError):
                    channel.send(RankStop("shutdown"), flags=zmq.NOBLOCK)
        stop_processes(self.processes, STOP_WAIT_S if ask else 0.0)
        if getattr(self, "tp", None) is not None:
            self.tp.close()
        self._finalizer.detach()
        for channel in self.channels:
            channel.close()
        self.context.term()


def custom_all_reduce(config: EngineConfig) -> bool:
    """Whether the group maps a one-shot all-reduce buffer: only GPUs of one node can."""
    return not config.disable_custom_all_reduce and config.nnodes == 1


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def spawn_rank(
    config: EngineConfig, rank: int, size: int, store_address: str, device: torch.device
) -> subprocess.Popen:
    """Start rank `rank` of `size` (a `rank_worker` process), which meets the others at the
    store at `store_address` (HOST:PORT)."""
    # NOTE: -P: the current directory cannot shadow the package (`local_process.child_python`).
    command = [
        sys.executable,
        "-P",
        "-m",
        config.rank_worker_module,
        "--rank",
        str(rank),
        "--size",
        str(size),
        "--store",
        store_address,
        "--device",
        str(device),
        "--config",
        json.dumps(dataclasses.asdict(config)),
    ]
    # NOTE: torch's C++ warnings would print a stack trace for a store that went away, which is
    # how a rank learns rank 0 ended; the rank logs that in one line itself.
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR", **os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, env=env)


def stop_processes(processes: list[subprocess.Popen], wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
