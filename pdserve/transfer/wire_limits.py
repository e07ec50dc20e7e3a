"""The largest frame each side accepts (zmq.MAXMSGSIZE), derived from the largest message a
legitimate peer sends; a bigger frame drops the connection before it is buffered. Torch-free.
"""

from __future__ import annotations

# Room for a control message's fixed fields, ids and failure messages, and a metadata
# header's top-logprob list (a few hundred entries at most).
CONTROL_OVERHEAD_BYTES = 64 << 10
# Decode -> prefill: control messages only (a transfer request carries page counts, not ids).
MAX_DECODE_MESSAGE_BYTES = CONTROL_OVERHEAD_BYTES
PAGE_ID_BYTES = 4  # `page_ids`: int32
# (A backend's own: `Backend.max_decode_message_bytes`.)


def max_prefill_frame_bytes(chunk_bytes: int, metadata_bytes: int) -> int:
    """Prefill -> decode: a KV chunk (tcp) or a metadata record's tensors, whichever is larger."""
    return CONTROL_OVERHEAD_BYTES + max(chunk_bytes, metadata_bytes)
