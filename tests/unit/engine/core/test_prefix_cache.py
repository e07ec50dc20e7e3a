"""The prefix cache's bookkeeping (torch-free): pages found again by their tokens, reference
counts, LRU eviction, and no page lost or shared by mistake under random interleavings."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.core.page_allocator import PageAllocator, pages_needed
from pdserve.engine.core.prefix_cache import PrefixCache

PAGE = 4


def _cache(num_pages: int = 64) -> PrefixCache:
    return PrefixCache(PageAllocator(num_pages), PAGE)


def _finish(cache: PrefixCache, tokens: list[int], computed: int | None = None) -> list[int]:
    """A request that computed `tokens` (no cached prefix) lets its pages go; returns them."""
    pages = cache.allocator.allocate(pages_needed(len(tokens), PAGE))
    spare = cache.insert(tokens, pages, len(tokens) if computed is None else computed, 0)
    cache.allocator.free(spare)
    return pages


def test_full_pages_are_found_again_and_the_partial_page_is_freed():
    cache = _cache()
    tokens = list(range(10))  # two full pages and two tokens
    pages = _finish(cache, tokens)
    assert cache.num_pages == 2 and cache.allocator.num_used == 2
    assert [n.page for n in cache.match(tokens, 10)] == pages[:2]
    assert [n.page for n in cache.match(tokens, 7)] == pages[:1]  # a page past the limit: no
    assert cache.match([0, 1, 2, 9, 4, 5, 6, 7], 8) == []  # differs inside the first page
    assert [n.page for n in cache.match([*range(4), 9, 9, 9, 9], 8)] == pages[:1]


def test_a_page_computed_twice_is_kept_once():
    cache = _cache()
    first = _finish(cache, list(range(8)))
    _finish(cache, list(range(8)))  # computed again before the first was found
    assert cache.num_pages == 2 and cache.allocator.num_used == 2
    assert [n.page for n in cache.match(list(range(8)), 8)] == first


def test_only_computed_tokens_are_cached():
    cache = _cache()
    _finish(cache, list(range(12)), computed=5)
    assert cache.num_pages == 1 and cache.allocator.num_used == 1


def test_referenced_pages_are_never_evicted_and_eviction_is_lru():
    cache = _cache()
    old = _finish(cache, [1] * 8)
    recent = _finish(cache, [2] * 8)
    reader = cache.match([2] * 8, 8)
    cache.acquire(reader)
    assert cache.num_unreferenced == 2  # the [1] * 8 pages
    assert cache.evict(10) == 2  # only the unreferenced path goes, leaf first
    assert cache.allocator.num_used == 2 and set(cache.pages()) == set(recent)
    assert not set(old) & set(cache.pages())
    cache.release(reader)
    _finish(cache, [3] * 8)
    cache.acquire(cache.match([2] * 8, 8))  # used again: now the newest
    cache.release(cache.match([2] * 8, 8))
    assert cache.evict(1) == 1
    assert cache.match([3] * 8, 8) == [cache.match([3] * 4, 4)[0]]  # [3]'s leaf went first
    with pytest.raises(RuntimeError, match="released more often"):
        cache.release(reader + reader)


def test_a_request_reading_cached_pages_adds_its_own_after_them():
    cache = _cache()
    _finish(cache, list(range(8)))
    tokens = [*range(8), 50, 51, 52, 53, 54]
    found = cache.match(tokens, 12)
    pages = cache.acquire(found) + cache.allocator.allocate(2)
    spare = cache.insert(tokens, pages, len(tokens), held=len(found))
    cache.release(found)
    cache.allocator.free(spare)
    assert spare == [pages[3]]  # the partial last page; the cached ones are not the caller's
    assert [n.page for n in cache.match(tokens, 12)] == pages[:3]
    assert cache.num_unreferenced == cache.num_pages == 3


def test_a_running_request_shares_its_pages_until_a_page_the_cache_holds_already():
    cache = _cache()
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    pages = cache.allocator.allocate(3)
    taken = cache.adopt(first, pages, 8, [])  # 2 full pages computed so far
    assert [n.page for n in taken] == pages[:2] and all(n.refs == 1 for n in taken)
    assert cache.num_unreferenced == 0
    # Another request reads them while the first still runs.
    assert [n.page for n in cache.match([*first, 10], 9)] == pages[:2]
    # A second request computed the same first page itself (admitted in the same step):
    # its copy stays its own, and so does every page after it.
    second = [1, 2, 3, 4, 7, 7, 7, 7, 0]
    own = cache.allocator.allocate(3)
    assert cache.adopt(second, own, 8, []) == []
    cache.release(taken)
    assert cache.num_unreferenced == 2
    # Letting go inserts the rest behind the pages it shared; nothing is lost.
    cache.allocator.free(cache.insert(first, pages, 9, len(taken)))
    cache.allocator.free(cache.insert(second, own, 9, 0))
    assert cache.allocator.num_used == cache.num_pages == 3  # [1-4], [5-8], [7 7 7 7]


def test_random_interleavings_keep_every_page_accounted_for():
    """Requests match, acquire, add pages, share them while running, and let them go (cached
    or not) in random order,
    with evictions whenever the allocator runs short: no page is lost or owned twice, no
    referenced page is evicted, counts never go negative, and all pages are free at the end."""
    rng = random.Random(7)
    for _ in range(30):
        cache = _cache(num_pages=24)
        allocator = cache.allocator
        live = []  # (tokens, pages, held nodes)
        for _ in range(200):
            if live and rng.random() < 0.2:  # a running request shares its computed pages
                tokens, pages, held = rng.choice(live)
                computed = rng.randint(len(held) * PAGE, len(tokens))
                held += cache.adopt(tokens, pages, computed, held)
            elif live and (rng.random() < 0.45 or allocator.num_free + cache.num_unreferenced < 6):
                tokens, pages, held = live.pop(rng.randrange(len(live)))
                if rng.random() < 0.8:
                    computed = rng.randint(len(held) * PAGE, len(tokens))
                    spare = cache.insert(tokens, pages, computed, len(held))
                else:  # a failed step: nothing is cached
                    spare = pages[len(held) :]
                cache.release(held)
                allocator.free(spare)
            else:
                stem = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5] * 12, []])
                tokens = stem + [rng.randrange(20) for _ in range(rng.randint(1, 9))]
                held = cache.match(tokens, len(tokens) - 1)
                pages = cache.acquire(held)
                needed = pages_needed(len(tokens), PAGE) - len(held)
                short = needed - allocator.num_free
                if short > 0:
                    cache.evict(short)
                if not allocator.can_allocate(needed):
                    cache.release(held)
                    continue
                live.append((tokens, pages + allocator.allocate(needed), held))
            _check(cache, live)
        for tokens, pages, held in live:
            cache.allocator.free(cache.insert(tokens, pages, len(tokens), len(held)))
            cache.release(held)
        _check(cache, [])
        assert cache.num_unreferenced == cache.num_pages
        cache.clear()
        assert allocator.num_free == 24 and cache.num_pages == 0


def _check(cache: PrefixCache, live) -> None:
    cached = cache.pages()
    owned = [p for _, pages, held in live for p in pages[len(held) :]]
    read = {p for _, pages, held in live for p in pages[: len(held)]}
    assert len(set(cached)) == len(cached) == cache.num_pages
    assert not set(owned) & set(cached) and len(set(owned)) == len(owned)
    assert read <= set(cached), "a page a request reads left the cache"
    assert len(cached) + len(owned) == cache.allocator.num_used
    assert 0 <= cache.num_unreferenced <= cache.num_pages
    referenced = {id(n) for _, _, held in live for n in held}
    assert cache.num_pages - cache.num_unreferenced == len(referenced)
