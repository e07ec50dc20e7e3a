"""Write events reused round-robin (`ipc_events`): a reader process that waits on
an event it opened once, by handle, sees every write whose announcement carried that event,
though the writer records the event again, for later writes, before the reader waits.
One GPU is enough."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

pytestmark = pytest.mark.gpu

WRITES = 64


def _reader(handles, values, opened_count) -> None:
    from pdserve.transfer.backends.ipc.ipc_events import OpenedEvents

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    slots = handles.get(timeout=60)  # the shared tensor the writer fills, one slot per write
    events = OpenedEvents(device)
    seen = []
    for _ in range(WRITES):
        index, handle = handles.get(timeout=60)
        event = events.open(handle)
        assert not isinstance(event, str), event
        torch.cuda.current_stream().wait_event(event)
        seen.append(int(slots[index].item()))
    values.put(seen)
    opened_count.put(len(events))


def test_a_reader_waiting_on_a_reused_event_sees_the_write_it_was_announced_with():
    from pdserve.transfer.backends.ipc.ipc_events import IpcEventRing

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    spawn = multiprocessing.get_context("spawn")
    handles, values, opened_count = spawn.Queue(), spawn.Queue(), spawn.Queue()
    reader = spawn.Process(target=_reader, args=(handles, values, opened_count))
    reader.start()
    slots = torch.zeros(WRITES, dtype=torch.int64, device=device)
    handles.put(slots)
    ring = IpcEventRing(device, size=2)
    for index in range(WRITES):
        # NOTE: each write lands ~2 ms after it is queued, so the reader waits on events
        # the writer has recorded again for later writes before it reads.
        torch.cuda._sleep(2_000_000)
        slots[index].fill_(index + 1)
        _, handle = ring.record()
        handles.put((index, handle))
    seen = values.get(timeout=120)
    reader.join(30)
    assert reader.exitcode == 0
    assert seen == list(range(1, WRITES + 1))
    assert opened_count.get(timeout=5) == 2  # NOTE: each handle opened once
