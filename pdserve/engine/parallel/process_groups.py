"""A tensor-parallel group's process group, and the one collective start-up runs on it
(every rank's smallest value: KV pages, a check that passed everywhere)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def all_reduce_min(group: dist.ProcessGroup, device: torch.device, value: int) -> int:
    """The smallest of every rank's `value` in `group` (a collective)."""
    x = torch.tensor([value], dtype=torch.int64, device=device)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    group.allreduce([x], options).wait()
    return int(x.item())


def open_group(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float
) -> dist.ProcessGroup:
    """The group's process group: NCCL between GPUs, gloo on CPU. A collective that waits
    past `timeout_s` fails (a rank died or hangs)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)
