"""A node other than 0 of a tensor-parallel worker that spans nodes (`pdserve serve --nnodes N
--node-rank K --dist-init-addr HOST:PORT`): it serves nothing itself; it starts this node's
ranks and watches them.

The ranks take rank 0's engine settings from its store (so the nodes cannot disagree on page
size, dtype or context length) and this node's own model directory. When one of them exits
with an error, the node posts it to the store (rank 0 fails its next pass with that message)
and stops the others; when rank 0 stops them (or goes away, and they leave), so does this
command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import signal
import time

import torch.distributed as dist

from pdserve.engine.core.config import EngineConfig
from pdserve.engine.ranks.rank_group import (
    CONFIG_KEY,
    DEAD_KEY,
    START_TIMEOUT_S,
    rank_device,
    spawn_rank,
    split_address,
    stop_processes,
)
from pdserve.engine.ranks.rank_worker import config_from_json
from pdserve.engine.runtime.loader import resolve_device

logger = logging.getLogger(__name__)

POLL_S = 0.2


def run_node_ranks(config: EngineConfig) -> int:
    """Start and watch this node's ranks; returns when they have all exited."""
    host, port = split_address(config.dist_init_addr)
    logger.info(
        "node %d of %d: waiting for rank 0 at %s", config.node_rank, config.nnodes, f"{host}:{port}"
    )
    store = dist.TCPStore(
        host,
        port,
        config.tp_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
    )
    settings = config_from_json(store.get(CONFIG_KEY).decode())
    settings = dataclasses.replace(settings, model_path=config.model_path)
    device = resolve_device(config.device)
    first = config.node_rank * config.ranks_per_node
    processes = {
        rank: spawn_rank(
            settings, rank, config.tp_size, f"{host}:{port}", rank_device(device, rank - first)
        )
        for rank in range(first, first + config.ranks_per_node)
    }
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        while not stopping:
            exited = {rank: p.poll() for rank, p in processes.items() if p.poll() is not None}
            failed = {rank: code for rank, code in exited.items() if code != 0}
            if failed:
                rank, code = next(iter(failed.items()))
                message = (
                    f"tensor-parallel rank {rank} on node {config.node_rank} exited with code "
                    f"{code}"
                )
                logger.error("%s; stopping this node's ranks", message)
                with contextlib.suppress(Exception):  # NOTE: rank 0 may be gone already
                    store.set(DEAD_KEY, message)
                return 1
            if len(exited) == len(processes):
                return 0
            time.sleep(POLL_S)
        return 0
    finally:
        stop_processes(list(processes.values()), 0.0)  # NOTE: only those still running
