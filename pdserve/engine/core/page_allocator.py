"""Torch-free page allocator for the paged KV cache.

The KV pool is an array of fixed-size pages; a request owns an ordered list of page ids.
This class only hands out and takes back ids: it never touches tensors, so every invariant
(no page owned twice, everything free after all requests end) is unit-tested on CPU.
"""

from __future__ import annotations


class PageAllocatorError(RuntimeError):
    """A caller broke the allocator's contract (double free, foreign page id)."""


class PageAllocator:
    """Hands out page ids in `[0, num_pages)`.

    `free` is reference-safe: freeing a page that is not currently allocated raises instead
    of silently putting it on the free list twice, which would let two requests share a page
    and corrupt each other's KV.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        # NOTE: a stack (pop from the end) reuses recently freed pages first, which keeps the
        # working set of the KV pool small and cache-friendly.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._allocated)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` pages; raises if fewer are free (check `can_allocate` first)."""
        if count < 0:
            raise PageAllocatorError(f"cannot allocate a negative number of pages ({count})")
        if count > len(self._free):
            raise PageAllocatorError(f"asked for {count} pages, only {len(self._free)} are free")
        pages = [self._free.pop() for _ in range(count)]
        self._allocated.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages; every id must be currently allocated and appear once."""
        if len(set(pages)) != len(pages):
            raise PageAllocatorError(f"duplicate page ids in free(): {sorted(pages)}")
        foreign = [p for p in pages if p not in self._allocated]
        if foreign:
            raise PageAllocatorError(f"freeing pages that are not allocated: {foreign[:8]}")
        self._allocated.difference_update(pages)
        self._free.extend(reversed(pages))


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)
