"""The names of what identifies a request's parts across processes. Torch-free.

Plain aliases (the wire carries str and int; the codec checks them as such), so that a
signature says which id it takes:
- `RequestId`: an engine request's id. A worker builds it from the HTTP request's id (the
  client's `X-Request-Id`, edge/request_ids.py): `cmpl-ID`, `cmpl-ID-1`, ...; every log line
  about the request names it.
- `RoomId`: a handoff's `bootstrap_room`, a random 63-bit number the router draws per attempt:
  it names the transfer between one prefill and one decode worker, not the request (a retry
  is a new room under the same request id).
- `PageIds`: a request's KV page ids in one pool, in sequence order (index i holds token slots
  [i * page_size, (i + 1) * page_size)).
"""

from __future__ import annotations

from typing import TypeAlias

RequestId: TypeAlias = str
RoomId: TypeAlias = int
PageIds: TypeAlias = list[int]
