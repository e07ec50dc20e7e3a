"""A page table that lives on the device: one row per running request, updated in place.

Building each step's page table from the requests' page lists costs host time in proportion
to the whole batch's context (every page id of every sequence, every step). Here a request
owns a row of one persistent device tensor while it runs, and a step writes only the page ids
that changed since the request's last step (a new page every `page_size` tokens), all in one
host-to-device copy (the scheduler marks where a request's pages changed:
`Request.pages_changed_from`). Kernels find sequence i's pages in row `rows[i]`.

The tensor is allocated once and never moves: CUDA graphs read it by address.
"""

from __future__ import annotations

import torch

from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.runtime.host_ints import host_ints


class PageTableFullError(RuntimeError):
    """More requests in one step than the table has rows, or a request with more pages than a
    row holds: the scheduler's limits were not kept."""


class DevicePageTable:
    def __init__(self, num_rows: int, max_pages: int, device: torch.device):
        self.max_pages = max_pages
        self.device = device
        self.table = torch.zeros((num_rows, max_pages), dtype=torch.int64, device=device)
        self._free = list(range(num_rows - 1, -1, -1))
        self._owners: dict[int, Request] = {}

    @staticmethod
    def bytes_for(num_rows: int, max_pages: int) -> int:
        return num_rows * max_pages * 8

    def rows(self, requests: list[Request]) -> list[int]:
        """The table rows of `requests`, with their current pages written there."""
        positions: list[int] = []
        page_ids: list[int] = []
        rows = []
        for request in requests:
            row = request.page_table_row
            synced = request.pages_changed_from
            if row is None or self._owners.get(row) is not request:
                row = request.page_table_row = self._take(request)
                synced = 0
            count = len(request.pages)
            if count > synced:
                if count > self.max_pages:
                    raise PageTableFullError(
                        f"request {request.request_id} holds {count} pages; a page-table row "
                        f"holds {self.max_pages}"
                    )
                start = row * self.max_pages
                positions.extend(range(start + synced, start + count))
                page_ids.extend(request.pages[synced:])
            # NOTE: after a trim the row keeps stale ids past `count`; kernels never read past
            # a sequence's KV length, and the next pages overwrite them.
            request.pages_changed_from = count
            rows.append(row)
        if positions:
            writes = host_ints(positions + page_ids).view(2, -1)
            writes = writes.to(self.device, non_blocking=True)
            self.table.view(-1).index_copy_(0, writes[0], writes[1])
        return rows

    def _take(self, request: Request) -> int:
        if not self._free:
            self._reclaim()
        if not self._free:
            raise PageTableFullError(
                f"all {len(self._owners)} page-table rows belong to running requests"
            )
        index = self._free.pop()
        self._owners[index] = request
        return index

    def _reclaim(self) -> None:
        """Free the rows of requests that stopped running (finished or preempted)."""
        for index, owner in list(self._owners.items()):
            if owner.status is not RequestStatus.RUNNING:
                del self._owners[index]
                owner.page_table_row = None
                self._free.append(index)
