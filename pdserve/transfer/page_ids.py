"""Page ids on the wire (the `ipc` backend's transfer request): int32, little-endian, as
bytes, so that a request for 64k pages is 256 KiB to check, not 64k msgpack integers.
Torch-free."""

from __future__ import annotations

import array
import sys

from pdserve.transfer.wire_limits import PAGE_ID_BYTES as _ITEM


def pack_page_ids(ids: list[int]) -> bytes:
    packed = array.array("i", ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_page_ids(data: bytes, count: int, num_pages: int) -> list[int] | str:
    """`count` page ids, each in [0, num_pages); what is wrong with `data` otherwise."""
    if len(data) != count * _ITEM:
        return f"{len(data)} bytes of page ids for {count} pages"
    ids = array.array("i")
    ids.frombytes(data)
    if sys.byteorder != "little":
        ids.byteswap()
    if ids and not (min(ids) >= 0 and max(ids) < num_pages):
        return f"page ids outside [0, {num_pages}) of the decode worker's pool"
    if len(set(ids)) != len(ids):
        return "a page id given twice"
    return ids.tolist()
