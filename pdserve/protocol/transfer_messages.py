"""Handshake and control messages between a prefill worker and a decode worker.

A connection starts with a challenge-response (`Hello`, `HelloReply`, then `Register`): each
side proves it holds the shared transfer token by an HMAC over both sides' fresh nonces, so
the token itself never crosses the wire and neither proof can be replayed. The decode side
then registers its layout; the prefill side compares it with its own and refuses a mismatch
with a reason that names every differing field. A prefill worker answers anything else from
a connection that has not registered with `NotRegistered`, carrying its instance id, so a
decode worker notices a restarted prefill worker and registers again.
"""

from __future__ import annotations

import dataclasses

from pdserve.protocol.codec import message
from pdserve.protocol.failures import Failure
from pdserve.protocol.ids import RoomId


@message("spec_layout")
class SpecLayout:
    """Speculative decoding settings both sides must share (None/0 without speculation)."""

    algorithm: str | None = None
    topk: int = 0
    num_steps: int = 0
    num_draft_tokens: int = 0
    spec_hidden_size: int | None = None
    hidden_dtype: str | None = None
    has_draft_kv: bool = False
    draft_num_layers: int = 0
    draft_fingerprint: str = ""  # the draft model's config, hashed ("" without one)


@message("kv_layout")
class KVLayout:
    """What must be equal on both sides for pages to be copied byte for byte."""

    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    kv_dtype: str
    spec: SpecLayout


@message("hello")
class Hello:
    """Decode -> prefill, first on every connection: decode's fresh nonce."""

    decode_id: str
    nonce: bytes


@message("hello_reply")
class HelloReply:
    """Prefill -> decode: prefill's fresh nonce and its proof of the token over both nonces.
    `instance` is random per prefill process, so a restart on the same address shows."""

    prefill_id: str
    instance: int
    nonce: bytes
    proof: bytes
    # Prefill's tensor-parallel size: with a torch.distributed backend each of its ranks sends
    # its KV heads to the decode ranks that hold them (`head_slices`).
    tp_size: int = 1
    # The `ipc` backend: this host and process (see `Register.host_id`), so that decode
    # knows when no write of prefill's can land in its pages any more (the process is gone).
    host_id: str = ""
    pid: int = 0
    # And the interprocess events its writes into decode's pages are marked with (handles,
    # `ipc_events`), which decode opens once, here, instead of as the writes come.
    events: list[bytes] = dataclasses.field(default_factory=list)


@message("not_registered")
class NotRegistered:
    """Prefill -> decode: this connection has not registered (say Hello first); `room` is the
    refused transfer request's room, or -1 for any other message."""

    instance: int
    room: RoomId = -1


@message("register")
class Register:
    """Decode -> prefill, after `HelloReply`: decode's proof of the token and its layout."""

    decode_id: str
    layout: KVLayout
    proof: bytes = b""
    backend: str = "tcp"
    # torch.distributed backends: decode's store (host:port) and this pair's group name.
    store_address: str = ""
    pair_name: str = ""
    tp_size: int = 1  # decode's tensor-parallel size (see `HelloReply.tp_size`)
    # The `ipc` backend: prefill writes KV straight into decode's pools, mapped through these
    # handles; both workers must be on one host (`host_id`: boot id and PID namespace).
    host_id: str = ""
    pid: int = 0
    pools: list[PoolHandle] = dataclasses.field(default_factory=list)
    # Where prefill may send its announcements straight from its engine thread (`ipc_lane`;
    # empty: over this connection).
    lane: str = ""


@message("pool_handle")
class PoolHandle:
    """A KV pool another process on this host may map (the `ipc` backend): a CUDA IPC
    handle of its allocation (`kind` "cuda"), or the descriptor by which the decode process
    holds its shared memory ("cpu", for CPU workers: `fd`, opened through /proc); what the
    fields mean is torch's storage sharing's. `shape` is the pool's
    `[2, layers, pages, page_size, kv_heads, head_dim]`."""

    kind: str
    shape: list[int]
    dtype: str
    handle: bytes
    size: int
    offset: int = 0
    fd: int = -1  # cpu: the decode process's descriptor of the pool's shared memory
    ref_counter: bytes = b""  # cuda: torch's IPC reference counter, and its offset
    ref_counter_offset: int = 0
    event: bytes = b""  # cuda: an event after the pool was allocated
    event_sync: bool = False


@message("register_ack")
class RegisterAck:
    prefill_id: str
    instance: int = 0


@message("register_rejected")
class RegisterRejected:
    reason: str


@message("transfer_request")
class TransferRequest:
    """Decode -> prefill: pages are reserved for this room; send when ready. The counts bound
    the room (a prompt within prefill's max_model_len never needs more). The first
    `num_cached_pages` target pages decode holds already (its prefix cache has the prompt's
    start): prefill sends none of them; at least the last page is always sent."""

    room: RoomId
    num_pages: int
    num_draft_pages: int
    num_cached_pages: int = 0
    # The `ipc` backend: decode's page ids (int32, little-endian), which prefill writes.
    page_ids: bytes = b""
    draft_page_ids: bytes = b""


@message("kv_piece")
class KVPiece:
    """Prefill -> decode: a piece of the room's KV, `nbytes` gathered from target pages
    [first_page, first_page + num_pages) and draft pages [first_draft_page, ...) of the room's
    page lists, pool by pool (see KVStager). Its bytes follow on the data plane: as `KVChunk`s
    (tcp), or as one send on the pair, posted in the order the pieces were announced
    (torch.distributed). A room's pieces cover each of its pages once, in any order.

    With `ipc` no bytes follow: prefill wrote them into decode's pages; on a GPU, `event` is
    a CUDA IPC event recorded after that write (decode's work on the pages waits for it)."""

    room: RoomId
    index: int
    first_page: int
    num_pages: int
    first_draft_page: int
    num_draft_pages: int
    nbytes: int
    event: bytes = b""


@message("kv_chunk")
class KVChunk:
    """Prefill -> decode header; the chunk's bytes follow as the next frame (tcp backend):
    bytes [offset, offset + nbytes) of the room's piece `piece`."""

    room: RoomId
    piece: int
    offset: int
    nbytes: int


@message("metadata_header")
class MetadataHeader:
    """Prefill -> decode: the request's first token and speculative seed state. The tensors
    (topk_index int64, topk_p float32, hidden_states) follow as the next frame, in that order."""

    room: RoomId
    first_token: int
    cached_tokens: int
    first_logprob: float | None = None
    # (token id, logprob) pairs of the first token's top alternatives, when the client asked.
    first_top_logprobs: list[list[int | float]] | None = None
    topk: int = 0
    has_hidden: bool = False


@message("room_done")
class RoomDone:
    """Prefill -> decode: everything for the room was sent or posted: `num_pieces` pieces,
    `total_bytes` of KV (on torch.distributed the last bytes may land after this)."""

    room: RoomId
    total_bytes: int
    num_pieces: int


@message("room_ack")
class RoomAck:
    """Decode -> prefill: the room arrived whole; prefill may free its pages."""

    room: RoomId


@message("room_released")
class RoomReleased:
    """Prefill -> decode (the `ipc` backend): the room ended here, every write into decode's
    pages for it has completed and none will start; decode may reuse its pages."""

    room: RoomId


@message("abort_room")
class AbortRoom:
    """Either direction: stop this room now, for this failure."""

    room: RoomId
    failure: Failure


@message("heartbeat")
class Heartbeat:
    sender_id: str
