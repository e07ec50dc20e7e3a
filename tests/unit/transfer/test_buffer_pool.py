import torch

from pdserve.transfer.buffer_pool import BufferPool


def test_buffers_are_reused_and_sized_exactly():
    pool = BufferPool(torch.device("cpu"))
    first = pool.take(1000)
    assert first.numel() == 1000 and first.dtype == torch.uint8
    pool.give(first)
    again = pool.take(600)
    assert again.numel() == 600
    assert again.data_ptr() == first.data_ptr()  # the same memory, handed out again
    assert pool.cached_bytes == 0


def test_smallest_fitting_buffer_is_chosen():
    pool = BufferPool(torch.device("cpu"))
    big, small = pool.take(2000), pool.take(800)
    pool.give(big)
    pool.give(small)
    assert pool.take(700).data_ptr() == small.data_ptr()
    assert pool.take(1500).data_ptr() == big.data_ptr()


def test_cache_is_bounded_dropping_the_smallest():
    pool = BufferPool(torch.device("cpu"), max_cached_bytes=3000)
    large, medium = pool.take(2000), pool.take(1500)
    pool.give(large)
    pool.give(medium)
    assert pool.cached_bytes == 2000
    assert pool.take(1900).data_ptr() == large.data_ptr()
