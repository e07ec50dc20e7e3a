"""The device page table: rows follow requests, only changed page ids are written. Pages
change through the scheduler (it marks where), as in the engine."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.core.page_allocator import PageAllocator
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.runtime.page_table import DevicePageTable, PageTableFullError


def scheduler(page_size: int = 1) -> Scheduler:
    config = SchedulerConfig(
        page_size=page_size, max_running_requests=4, prefill_token_budget=64, split_prompts=True
    )
    return Scheduler(config, PageAllocator(32))


def running(name: str, pages: list[int]) -> Request:
    request = Request(name, [1, 2, 3], SamplingParams(), max_total_tokens=64)
    request.status = RequestStatus.RUNNING
    request.pages = list(pages)
    return request


def row_pages(table: DevicePageTable, row: int, count: int) -> list[int]:
    return table.table[row, :count].tolist()


def test_rows_hold_each_requests_pages_and_only_new_pages_are_written():
    table = DevicePageTable(num_rows=3, max_pages=4, device=torch.device("cpu"))
    a, b = running("a", [7, 2]), running("b", [5])
    rows = table.rows([a, b])
    assert len(set(rows)) == 2
    assert row_pages(table, rows[0], 2) == [7, 2]
    assert row_pages(table, rows[1], 1) == [5]
    # Scribble over a's synced entries: a later step must write only its new page.
    table.table[rows[0], :2] = -5
    a.pages.append(9)
    assert table.rows([b, a]) == [rows[1], rows[0]]
    assert row_pages(table, rows[0], 3) == [-5, -5, 9]


def test_a_preempted_request_is_rewritten_from_its_first_page():
    table = DevicePageTable(num_rows=2, max_pages=4, device=torch.device("cpu"))
    sched = scheduler()
    a = running("a", sched.allocator.allocate(2))
    sched.running.append(a)
    (row,) = table.rows([a])
    sched._preempt(a)
    a.status = RequestStatus.RUNNING  # readmitted with fresh pages, before a step saw it
    a.pages.extend([6, 4, 3])
    assert table.rows([a]) == [row]
    assert row_pages(table, row, 3) == [6, 4, 3]


@pytest.mark.parametrize("seen_between", [True, False])
def test_a_trimmed_request_gets_its_next_pages_where_the_trimmed_ones_were(seen_between):
    """Speculative KV rejected: pages trimmed, then the request grows again, to as many pages
    as before, with or without a step that read the table in between."""
    table = DevicePageTable(num_rows=1, max_pages=4, device=torch.device("cpu"))
    sched = scheduler()
    a = running("a", sched.allocator.allocate(3))
    first = a.pages[0]
    (row,) = table.rows([a])
    sched.trim_pages(a, 1)
    if seen_between:
        table.rows([a])
    a.pages += [28, 29]
    table.rows([a])
    assert row_pages(table, row, 3) == [first, 28, 29]


def test_rows_of_requests_that_stopped_running_are_reused():
    table = DevicePageTable(num_rows=2, max_pages=2, device=torch.device("cpu"))
    a, b, c = running("a", [1]), running("b", [2]), running("c", [3])
    rows = table.rows([a, b])
    with pytest.raises(PageTableFullError, match="2 page-table rows"):
        table.rows([c])
    a.status = RequestStatus.FINISHED
    (row_c,) = table.rows([c])
    assert row_c == rows[0]
    assert row_pages(table, row_c, 1) == [3]
    # a comes back (it was preempted, not finished): it needs a row again, b's is kept.
    a.status = RequestStatus.RUNNING
    with pytest.raises(PageTableFullError):
        table.rows([a])
    assert table.rows([b]) == [rows[1]]


def test_a_request_with_more_pages_than_a_row_holds_is_refused():
    table = DevicePageTable(num_rows=1, max_pages=2, device=torch.device("cpu"))
    with pytest.raises(PageTableFullError, match="holds 3 pages; a page-table row holds 2"):
        table.rows([running("a", [1, 2, 3])])
