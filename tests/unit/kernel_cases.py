"""Random paged-attention cases and a float64 reference, shared by the CPU (interpreter) and
GPU kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    k_cache: torch.Tensor  # [num_pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    page_table: torch.Tensor  # [B, max_pages], pages in random order
    kv_lens: list[int]


def paged_case(
    kv_lens: list[int],
    *,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    generator: torch.Generator,
) -> PagedCase:
    """Random K/V for sequences of `kv_lens` tokens, on pages scattered through a pool with
    spare pages (so a kernel reading the wrong page reads other random data)."""
    counts = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(counts) + 3
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=generator).to(dtype).to(device)
    order = torch.randperm(num_pages, generator=generator).tolist()
    table = torch.zeros(len(kv_lens), max(counts), dtype=torch.int64)
    for i, count in enumerate(counts):
        table[i, :count] = torch.tensor(order[:count])
        order = order[count:]
    return PagedCase(k_cache, v_cache, table.to(device), list(kv_lens))


def reference_attention(
    q: torch.Tensor,  # [query_len, heads, head_dim]
    case: PagedCase,
    seq: int,
    *,
    scale: float,
    sliding_window: int | None = None,
    mask: torch.Tensor | None = None,  # [query_len, kv_len] bool
) -> torch.Tensor:
    """float64 attention of `seq`'s last `query_len` tokens over its cached keys: causal
    (with an optional sliding window) unless `mask` says which keys each query sees."""
    kv_len = case.kv_lens[seq]
    page_size, kv_heads, head_dim = case.k_cache.shape[1:]
    pages = case.page_table[seq, : -(-kv_len // page_size)].cpu()
    keys = case.k_cache.cpu()[pages].reshape(-1, kv_heads, head_dim)[:kv_len].double()
    values = case.v_cache.cpu()[pages].reshape(-1, kv_heads, head_dim)[:kv_len].double()
    query_len, num_heads = q.shape[0], q.shape[1]
    group = num_heads // kv_heads
    if mask is None:
        query_index = torch.arange(kv_len - query_len, kv_len)[:, None]
        key_index = torch.arange(kv_len)[None, :]
        mask = key_index <= query_index
        if sliding_window is not None:
            mask &= key_index > query_index - sliding_window
    mask = mask.cpu()
    out = torch.empty(query_len, num_heads, head_dim, dtype=torch.float64)
    for head in range(num_heads):
        scores = q[:, head].cpu().double() @ keys[:, head // group].T * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        out[:, head] = torch.softmax(scores, dim=-1) @ values[:, head // group]
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.cpu().double(), want.cpu().double()
    return float((got - want).norm() / want.norm())


def tolerance(dtype: torch.dtype) -> float:
    """Relative error allowed against the float64 reference: float32 arithmetic, or the
    rounding of bf16/fp16 operands and outputs (the interpreter truncates to bf16 rather
    than rounding, which doubles the error)."""
    return 1e-5 if dtype == torch.float32 else 1.5e-2
