"""The CUDA events the `ipc` backend marks its writes into decode's pages with, kept and
reused on both sides instead of made for each write.

A write's announcement carries an interprocess event recorded after the copy (`ipc_plane`);
decode's commit makes its stream wait for it. On an H100 host creating one and taking its
handle cost the prefill worker's thread ~20 µs (recording a kept one ~9), and opening a handle
cost decode's IO thread ~160 µs, a fifth of a 16 MiB handoff then. So prefill records its
writes round-robin into a ring of events made at start (`IpcEventRing`), whose handles go to
each decode peer in the handshake (`HelloReply.events`), and decode opens them there, once
(`OpenedEvents`: ~40 ms of its IO thread per prefill peer); a handle it does not know yet is
opened when announced.

Why reuse is safe: every write of a worker is queued on one stream, in order, and waiting for
an event waits for its latest record when the wait is queued. An announcement leaves after
its write's record, so whatever decode waits on then is that record or a later one on the
same stream, which completes after it: decode may wait longer, never less. (How much longer:
until the write `RING_SIZE` writes later, if that was recorded before decode's commit queued
its wait; with 256, only a burst of writes can come round that fast, and a burst's writes
follow one another.) The same holds for the prefill thread that counts a write complete when
its event is.
"""

from __future__ import annotations

import torch

# NOTE: a slot comes round again after this many writes; until then its record is the
# write's own (a later one only lengthens what waits for it, see above).
RING_SIZE = 256
MAX_OPENED = 4 * RING_SIZE  # events decode keeps open per prefill peer
IPC_EVENT_BYTES = 64  # CUDA_IPC_HANDLE_SIZE


class IpcEventRing:
    """The prefill worker's thread's events, on one device, made at once: their handles go
    to each decode peer in the handshake (`HelloReply.events`)."""

    def __init__(self, device: torch.device, size: int = RING_SIZE):
        stream = torch.cuda.current_stream(device)
        self._events = []
        for _ in range(size):
            # NOTE: recorded before its handle is taken: that makes it on the stream's device.
            event = torch.cuda.Event(interprocess=True)
            event.record(stream)
            self._events.append(event)
        self.handles = [event.ipc_handle() for event in self._events]
        self.device = device
        self._next = 0

    def record(self, stream: torch.cuda.Stream | None = None) -> tuple[torch.cuda.Event, bytes]:
        """An interprocess event recorded now on `stream` (the device's current one), and
        its handle."""
        index = self._next
        self._next = (index + 1) % len(self._events)
        event = self._events[index]
        event.record(stream or torch.cuda.current_stream(self.device))
        return event, self.handles[index]


class OpenedEvents:
    """Decode's side (IO thread): the events one prefill peer announced, opened once each."""

    def __init__(self, device: torch.device, limit: int = MAX_OPENED):
        self.device = device
        self._limit = limit
        self._events: dict[bytes, torch.cuda.Event] = {}

    def open(self, handle: bytes) -> torch.cuda.Event | str:
        """The event behind `handle`; what is wrong with it, if it cannot be opened."""
        event = self._events.get(handle)
        if event is not None:
            return event
        if self.device.type != "cuda" or len(handle) != IPC_EVENT_BYTES:
            return f"a {len(handle)}-byte event for {self.device}"
        try:
            event = torch.cuda.Event.from_ipc_handle(self.device, handle)
        except RuntimeError as e:
            return f"could not open prefill's write event: {e}"
        if len(self._events) >= self._limit:
            # NOTE: a peer that makes new events instead of reusing them: rooms that hold
            # one keep it alive; the rest are opened again if announced again.
            self._events.clear()
        self._events[handle] = event
        return event

    def open_all(self, handles: list[bytes]) -> str | None:
        """Open a peer's events, announced in its handshake; what is wrong, if one fails."""
        if len(handles) > self._limit:
            return f"{len(handles)} write events, more than the {self._limit} decode keeps"
        for handle in handles:
            event = self.open(handle)
            if isinstance(event, str):
                return event
        return None

    def __len__(self) -> int:
        return len(self._events)
