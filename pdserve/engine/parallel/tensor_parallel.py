"""Tensor parallelism: how a model splits over `size` ranks, and the collectives of its forward.

Megatron's split, as SGLang and vLLM use it: q/k/v and gate/up are column-parallel (each rank
computes its own heads and its own slice of the MLP), o and down are row-parallel (each rank
multiplies its slice, one all-reduce sums them), the embedding and the LM head split the
vocabulary. A rank holds `num_heads / size` query heads and the KV heads they read:
`num_kv_heads / size` of them, or, with fewer KV heads than ranks, the one its query heads
share (a KV head is then replicated on `size / num_kv_heads` ranks). Every rank computes the
same hidden states; only rank 0 samples.

`ModelSplit` is the arithmetic (torch-free, checked before anything loads); `TensorParallel`
is one rank's place in the group and its collectives. Size 1 is no group at all: the layers
then are plain modules and no collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pdserve.engine.parallel.process_groups import all_reduce_min, open_group

if TYPE_CHECKING:
    from pdserve.engine.parallel.symmetric_all_reduce import SymmetricAllReduce


class TensorParallelError(ValueError):
    """A model that cannot be split this many ways, or a group that cannot start; the message
    names which dimension does not divide."""


@dataclass(frozen=True)
class ModelSplit:
    """How one model's heads, MLP and vocabulary divide among `size` ranks."""

    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        size = self.size
        if size < 1:
            raise TensorParallelError(f"--tp-size must be >= 1, got {size}")
        if self.num_heads % size:
            raise TensorParallelError(
                f"--tp-size {size} does not divide the model's {self.num_heads} attention heads"
            )
        kv = self.num_kv_heads
        if kv % size and size % kv:
            raise TensorParallelError(
                f"--tp-size {size} and the model's {kv} KV heads: one must divide the other "
                "(each rank owns whole KV heads, or ranks share one)"
            )
        if self.intermediate_size % size:
            raise TensorParallelError(
                f"--tp-size {size} does not divide the model's intermediate_size "
                f"{self.intermediate_size}"
            )

    @classmethod
    def of(cls, model_config, size: int) -> ModelSplit:
        c = model_config
        return cls(size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size)

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.size

    @property
    def kv_heads_per_rank(self) -> int:
        return max(self.num_kv_heads // self.size, 1)

    def kv_head_start(self, rank: int) -> int:
        """The first KV head rank `rank` owns (ranks sharing a replicated head agree)."""
        return rank * self.num_kv_heads // self.size

    @property
    def intermediate_per_rank(self) -> int:
        return self.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        """Rows of the embedding and LM head per rank; the last rank's run past the
        vocabulary when it does not divide (those rows stay zero and are never sampled)."""
        return -(-self.vocab_size // self.size)

    def vocab_rows(self, rank: int) -> tuple[int, int]:
        """(first vocabulary id, how many real ids) of rank `rank`'s rows."""
        start = rank * self.vocab_per_rank
        return start, max(min(self.vocab_per_rank, self.vocab_size - start), 0)

    def checkpoint_slice(self, target: str, part: int | None, rank: int):
        """Which slice of a checkpoint tensor a rank loads: `(dim, start, length)` of the
        tensor named by the model parameter `target` (for fused q/k/v and gate/up, of its
        `part`), or None for a tensor every rank holds whole."""
        d = self.head_dim
        if target.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            if part == 0:
                return 0, rank * self.heads_per_rank * d, self.heads_per_rank * d
            return 0, self.kv_head_start(rank) * d, self.kv_heads_per_rank * d
        if target.endswith("gate_up_proj.weight"):
            return 0, rank * self.intermediate_per_rank, self.intermediate_per_rank
        if target.endswith("o_proj.weight"):
            return 1, rank * self.heads_per_rank * d, self.heads_per_rank * d
        if target.endswith("down_proj.weight"):
            return 1, rank * self.intermediate_per_rank, self.intermediate_per_rank
        if target.endswith(("embed_tokens.weight", "lm_head.weight")):
            start, count = self.vocab_rows(rank)
            return 0, start, count
        return None


class TensorParallel:
    """One rank of a tensor-parallel group: its split, and the collectives layers call.

    The group is a process group of its own (not torch.distributed's global one), so that
    several engines can live in one process, one after another or side by side."""

    def __init__(
        self,
        split: ModelSplit,
        rank: int,
        group: dist.ProcessGroup,
        device,
        small: SymmetricAllReduce | None = None,
    ):
        if not 0 <= rank < split.size:
            raise TensorParallelError(f"rank {rank} outside a group of {split.size}")
        self.split = split
        self.size = split.size
        self.rank = rank
        self.group = group
        self.device = torch.device(device)
        # The one-shot all-reduce for what fits its buffer (decode steps), or None.
        self.small = small

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks (in place under NCCL; use the result)."""
        if self.small is not None and self.small.fits(x):
            return self.small(x)
        self.group.allreduce([x]).wait()
        return x

    def sum_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm):
        """`norm.normed(sum of x over the ranks, residual)`: one kernel (the one-shot
        all-reduce with the residual add and the RMSNorm in it) where `x` fits the one-shot
        path and the norm is a fused one (the same numerics), else the all-reduce and then
        the norm. `norm`: an `RMSNorm` (`models/layers.py`)."""
        small = self.small
        if residual is not None and norm.fused and small is not None and small.fits(x):
            return small.sum_and_norm(x, residual, norm.weight, norm.eps)
        return norm.normed(self.all_reduce(x), residual)

    def all_reduce_async(self, x: torch.Tensor) -> PendingSum:
        """Start summing `x` over the ranks; `wait()` gives the sum. Under NCCL the sum runs
        on NCCL's stream, so what the caller launches meanwhile (the other half of a pass
        run as two) overlaps it; the one-shot path sums at once."""
        if self.small is not None and self.small.fits(x):
            return PendingSum(self.small(x))
        return PendingSum(x, self.group.allreduce([x]))

    def close(self) -> None:
        if self.small is not None:
            self.small.close()
            self.small = None

    def all_reduce_min(self, value: int) -> int:
        """The smallest of every rank's `value` (start-up: KV pages every rank can hold)."""
        return all_reduce_min(self.group, self.device, value)

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of the last (vocabulary) dimension side by side, cut to the
        vocabulary."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)[..., : self.split.vocab_size]

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([x], options).wait()
        return x


class PendingSum:
    """An all-reduce started by `TensorParallel.all_reduce_async`."""

    def __init__(self, tensor: torch.Tensor, work: dist.Work | None = None):
        self._tensor = tensor
        self._work = work

    def wait(self) -> torch.Tensor:
        """The sum. Under NCCL the host does not wait: the current stream does."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._tensor


def join_group(
    split: ModelSplit,
    rank: int,
    store: dist.Store,
    device: torch.device,
    dtype: torch.dtype,
    *,
    timeout_s: float,
    custom_all_reduce: bool,
) -> TensorParallel:
    """This rank's place in the group (every rank calls it): the process group, and with
    `custom_all_reduce` (GPUs of one node) the one-shot all-reduce for small tensors."""
    from pdserve.engine.parallel.symmetric_all_reduce import SymmetricAllReduce

    group = open_group(store, rank, split.size, device, timeout_s)
    small = None
    if custom_all_reduce:
        small = SymmetricAllReduce.open(
            group, store, rank, split.size, device, dtype, timeout_s=timeout_s
        )
    return TensorParallel(split, rank, group, device, small)
