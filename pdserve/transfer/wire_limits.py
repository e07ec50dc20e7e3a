"""The largest frame each side accepts (zmq.MAXMSGSIZE), derived from the largest message a
legitimate peer sends; a bigger frame drops the connection before it is buffered. Torch-free.
"""

from __future__ import annotations

# Room for a control message's fixed fields, ids and reason strings, and a metadata header's
# top-logprob list (a few hundred entries at most).
CONTROL_OVERHEAD_BYTES = 64 << 10
# msgpack spends at most 9 bytes on an integer.
BYTES_PER_PAGE_ID = 9


def max_decode_message_bytes(max_room_pages: int) -> int:
    """Decode -> prefill: the largest is a transfer request (page ids, draft page ids)."""
    return CONTROL_OVERHEAD_BYTES + 2 * BYTES_PER_PAGE_ID * max_room_pages


def max_prefill_frame_bytes(chunk_bytes: int, metadata_bytes: int) -> int:
    """Prefill -> decode: a KV chunk (tcp) or a metadata record's tensors, whichever is larger."""
    return CONTROL_OVERHEAD_BYTES + max(chunk_bytes, metadata_bytes)
