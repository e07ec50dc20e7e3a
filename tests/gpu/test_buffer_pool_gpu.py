"""Receive buffers on a GPU: a new one is allocated on the stream that writes it first, so a
transfer never lands in a block the caching allocator took back from work still queued on
another stream (a forward pass's temporaries), and one given back is not handed out again
before the giver's work on it is done."""

from __future__ import annotations

import pytest
import torch

from pdserve.transfer.buffer_pool import BufferPool

pytestmark = pytest.mark.gpu


@pytest.fixture
def device():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return torch.device("cuda", torch.cuda.current_device())


def test_a_new_buffer_never_reuses_a_block_another_stream_still_uses(device):
    writer = torch.cuda.Stream(device)
    nbytes = 8 << 20
    busy = torch.empty(nbytes, dtype=torch.uint8, device=device)
    torch.cuda._sleep(200_000_000)  # NOTE: the default stream is busy a while
    busy.fill_(1)  # queued behind the sleep: the block is in use until it runs
    freed_at = busy.data_ptr()
    del busy  # back to the allocator at once, as a pass's temporaries are
    plain = torch.empty(nbytes, dtype=torch.uint8, device=device)
    assert plain.data_ptr() == freed_at, "the allocator reuses the block on its own stream"
    del plain
    received = BufferPool(device).take(nbytes, writer=writer)
    assert received.data_ptr() != freed_at, "a transfer's buffer must not alias it"
    torch.cuda.synchronize(device)


def test_a_buffer_given_back_waits_for_the_givers_work(device):
    writer = torch.cuda.Stream(device)
    pool = BufferPool(device)
    first = pool.take(1 << 20, writer=writer)
    torch.cuda._sleep(200_000_000)
    first.fill_(7)  # the giver's work, still queued
    pool.give(first)
    again = pool.take(1 << 20, writer=writer)
    assert again.data_ptr() == first.data_ptr()
    with torch.cuda.stream(writer):
        again.fill_(3)  # must run after the giver's fill
    torch.cuda.synchronize(device)
    assert int(again[0]) == 3
