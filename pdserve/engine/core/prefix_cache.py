"""Prefix caching: full KV pages of earlier requests, found again by the tokens they hold.

Torch-free. The cache is a tree of pages: a node is one full page of KV, keyed by its
`page_size` tokens under its parent (the pages before it), so the path from the root to a
node spells a token prefix and the node's page holds that prefix's last page of KV. A new
request walks its prompt down the tree and starts computing after the last page found.

Ownership. A page is in exactly one of three places: free in the allocator, owned by a
request (its `pages` past the cached ones), or owned by the cache (a node). A request that
reuses cached pages holds a reference on each of their nodes; a referenced node is never
evicted, so its page is never freed or overwritten while a request reads it. When a request
lets its pages go (finished, aborted, preempted), its full pages of computed KV join the tree
(or are freed, where an equal page is already there) and its references are dropped.

Eviction frees the least recently used unreferenced leaves, one page each, when the
allocator runs short: a parent becomes a leaf once its last child is gone, so a long unused
path is freed from its end.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.core.page_allocator import PageAllocator


@dataclass(eq=False)
class CachedPage:
    """A node of the tree: one full page of KV."""

    page: int
    key: tuple[int, ...]  # the page's tokens
    parent: CachedPage | None
    children: dict[tuple[int, ...], CachedPage] = field(default_factory=dict)
    refs: int = 0  # requests reading this page now
    last_used: int = 0  # the cache's clock at the latest match or insert through here


@dataclass
class PromptPages:
    """Pages reserved for a prompt whose KV arrives by transfer (a decode worker): `pages`
    begins with the pages of `cached` (nodes it holds references on; their KV is there
    already), the rest are free pages taken for the transfer to fill."""

    pages: list[int]
    cached: list[CachedPage]


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self._root = CachedPage(page=-1, key=(), parent=None)
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages the cache owns
        self.num_unreferenced = 0  # of those, pages no request reads (evictable, in time)
        # Unreferenced leaves by last use, with stale entries skipped when popped.
        self._leaves: list[tuple[int, int, CachedPage]] = []
        self._tiebreak = itertools.count()
        # Counters for metrics.
        self.num_evicted = 0

    # ---- lookups ----------------------------------------------------------------------

    def match(self, token_ids: Sequence[int], max_tokens: int) -> list[CachedPage]:
        """The cached pages that hold `token_ids`' longest cached prefix of at most
        `max_tokens` tokens, in order. Nothing is referenced yet (`acquire` does that)."""
        size = self.page_size
        node, found = self._root, []
        for start in range(0, max_tokens - size + 1, size):
            child = node.children.get(tuple(token_ids[start : start + size]))
            if child is None:
                break
            found.append(child)
            node = child
        return found

    def acquire(self, nodes: list[CachedPage]) -> list[int]:
        """Reference `nodes` (a request now reads their pages); returns their page ids."""
        now = next(self._clock)
        for node in nodes:
            if node.refs == 0:
                self.num_unreferenced -= 1
            node.refs += 1
            node.last_used = now
        return [node.page for node in nodes]

    def release(self, nodes: list[CachedPage]) -> None:
        """Drop one reference on each of `nodes`."""
        for node in nodes:
            if node.refs <= 0:
                raise RuntimeError("prefix cache: a page released more often than acquired")
            node.refs -= 1
            if node.refs == 0:
                self.num_unreferenced += 1
                self._maybe_evictable(node)

    # ---- filling ----------------------------------------------------------------------

    def insert(
        self, token_ids: Sequence[int], pages: list[int], num_tokens: int, held: int
    ) -> list[int]:
        """Take the full pages of `num_tokens` computed tokens of a request that lets its
        pages go: `pages[:held]` are cached pages it reads (it holds references on them), the
        rest are its own. Returns its own pages the cache did not keep (the caller frees
        them): the partial last page, pages past the computed tokens, and pages whose
        tokens the cache already holds in another page."""
        size = self.page_size
        full = min(num_tokens // size, len(pages))
        now = next(self._clock)
        node, spare = self._root, []
        for index in range(full):
            key = tuple(token_ids[index * size : (index + 1) * size])
            child = node.children.get(key)
            if child is None:
                if index < held:
                    raise RuntimeError("prefix cache: a referenced page left the tree")
                child = CachedPage(page=pages[index], key=key, parent=node)
                node.children[key] = child
                self.num_pages += 1
                self.num_unreferenced += 1
            elif child.page != pages[index] and index >= held:
                spare.append(pages[index])  # computed twice: the cache keeps its own copy
            child.last_used = now
            self._maybe_evictable(child)  # NOTE: a leaf's last use moved: a fresh heap entry
            node = child
        spare.extend(pages[max(full, held) :])
        return spare

    def adopt(
        self, token_ids: Sequence[int], pages: list[int], num_tokens: int, held: list[CachedPage]
    ) -> list[CachedPage]:
        """Take the full pages of `num_tokens` computed tokens of a request that keeps
        running, past the cached pages `held` it reads (the first of `pages`), while the path
        is new to the tree; the request holds a reference on each page taken (returned, in
        order). Stops at a page whose tokens the cache holds in another page (computed twice
        at once): that page and the rest stay the request's own."""
        size = self.page_size
        node = held[-1] if held else self._root
        now = next(self._clock)
        taken: list[CachedPage] = []
        for index in range(len(held), min(num_tokens // size, len(pages))):
            key = tuple(token_ids[index * size : (index + 1) * size])
            if key in node.children:
                break
            child = CachedPage(page=pages[index], key=key, parent=node, refs=1, last_used=now)
            node.children[key] = child
            self.num_pages += 1
            taken.append(child)
            node = child
        return taken

    # ---- eviction ---------------------------------------------------------------------

    def evict(self, count: int) -> int:
        """Free up to `count` pages, least recently used unreferenced leaves first; returns
        how many were freed."""
        freed = []
        while len(freed) < count and self._leaves:
            entry = heapq.heappop(self._leaves)
            if not self._is_live(entry):
                continue  # stale: referenced, grown, evicted or used again since
            node = entry[2]
            del node.parent.children[node.key]
            freed.append(node.page)
            self._maybe_evictable(node.parent)
            node.parent = None
        self.num_pages -= len(freed)
        self.num_unreferenced -= len(freed)
        self.num_evicted += len(freed)
        if freed:
            self.allocator.free(freed)
        return len(freed)

    def clear(self) -> int:
        """Evict every unreferenced page; returns how many were freed."""
        return self.evict(self.num_pages)

    def _maybe_evictable(self, node: CachedPage) -> None:
        if node is self._root or node.refs or node.children:
            return
        heapq.heappush(self._leaves, (node.last_used, next(self._tiebreak), node))
        if len(self._leaves) > 4 * max(self.num_pages, 1024):
            # NOTE: stale entries pile up where nothing is evicted for long; keep the live ones.
            self._leaves = [e for e in self._leaves if self._is_live(e)]
            heapq.heapify(self._leaves)

    @staticmethod
    def _is_live(entry: tuple[int, int, CachedPage]) -> bool:
        last_used, _, node = entry
        return (
            not node.refs
            and not node.children
            and node.parent is not None
            and node.last_used == last_used
        )

    # ---- checks -----------------------------------------------------------------------

    def pages(self) -> list[int]:
        """Every page the cache owns (for invariant checks)."""
        found, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            found.append(node.page)
            stack.extend(node.children.values())
        return found
