import random

import pytest

from pdserve.engine.core.page_allocator import PageAllocator, PageAllocatorError, pages_needed


def test_allocate_and_free_round_trip():
    allocator = PageAllocator(8)
    pages = allocator.allocate(5)
    assert len(set(pages)) == 5 and allocator.num_free == 3
    allocator.free(pages)
    assert allocator.num_free == 8 and allocator.num_used == 0


def test_over_allocation_raises_and_changes_nothing():
    allocator = PageAllocator(4)
    allocator.allocate(3)
    with pytest.raises(PageAllocatorError, match="only 1 are free"):
        allocator.allocate(2)
    assert allocator.num_free == 1


def test_double_free_is_refused():
    allocator = PageAllocator(4)
    pages = allocator.allocate(2)
    allocator.free(pages)
    with pytest.raises(PageAllocatorError, match="not allocated"):
        allocator.free(pages)
    assert allocator.num_free == 4


def test_duplicate_ids_in_one_free_are_refused():
    allocator = PageAllocator(4)
    page = allocator.allocate(1)[0]
    with pytest.raises(PageAllocatorError, match="duplicate"):
        allocator.free([page, page])


def test_random_mix_never_hands_out_a_page_twice():
    allocator = PageAllocator(64)
    owned: list[list[int]] = []
    rng = random.Random(0)
    for _ in range(2000):
        if owned and rng.random() < 0.5:
            allocator.free(owned.pop(rng.randrange(len(owned))))
        else:
            count = rng.randint(0, 6)
            if allocator.can_allocate(count):
                owned.append(allocator.allocate(count))
        flat = [p for pages in owned for p in pages]
        assert len(flat) == len(set(flat)) == allocator.num_used
        assert allocator.num_used + allocator.num_free == 64
    for pages in owned:
        allocator.free(pages)
    assert allocator.num_free == 64


@pytest.mark.parametrize(
    ("tokens", "size", "pages"), [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (5, 1, 5)]
)
def test_pages_needed(tokens, size, pages):
    assert pages_needed(tokens, size) == pages
