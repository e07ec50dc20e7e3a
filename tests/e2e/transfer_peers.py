"""Child-process bodies for the transfer tests: a prefill peer and a decode peer, each in its
own process, talking over loopback. Results come back through multiprocessing queues."""

from __future__ import annotations

import dataclasses
import os
import time
import traceback

import torch

from pdserve.engine.runtime.kv_pool import KVPool
from pdserve.protocol.failures import FailureKind
from pdserve.protocol.metadata_spec import MetadataSpec
from pdserve.protocol.transfer_messages import KVLayout, SpecLayout
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.kv_staging import KVStager
from pdserve.transfer.metadata import MetadataRecord
from pdserve.transfer.room_state import TransferState
from tests.waiting import wait_until


@dataclasses.dataclass(frozen=True)
class Case:
    room: int
    page_size: int = 16
    draft: bool = False
    prefill_pages: tuple[int, ...] = (5, 2, 9)
    decode_pages: tuple[int, ...] = (0, 7, 3)
    hidden: bool = True
    layers: int = 3


def layout(case: Case, **changes) -> KVLayout:
    spec = SpecLayout(
        algorithm="EAGLE" if case.hidden else None,
        topk=2 if case.hidden else 0,
        num_steps=3,
        spec_hidden_size=8 if case.hidden else None,
        hidden_dtype="bfloat16" if case.hidden else None,
        has_draft_kv=case.draft,
        draft_num_layers=1 if case.draft else 0,
    )
    spec_changes = {k[5:]: changes.pop(k) for k in list(changes) if k.startswith("spec_")}
    spec = dataclasses.replace(spec, **spec_changes)
    base = KVLayout(
        model_fingerprint="tiny",
        num_layers=case.layers,
        num_kv_heads=2,
        head_dim=8,
        page_size=case.page_size,
        kv_dtype="bfloat16",
        spec=spec,
    )
    return dataclasses.replace(base, **changes)


def metadata_spec(case: Case) -> MetadataSpec:
    if case.hidden:
        return MetadataSpec(topk=2, hidden_size=8, hidden_dtype="bfloat16")
    return MetadataSpec()


def pools(case: Case, num_pages: int, seed: int | None) -> list[KVPool]:
    shapes = [(case.layers, torch.bfloat16)] + ([(1, torch.float32)] if case.draft else [])
    result = []
    for i, (layers, dtype) in enumerate(shapes):
        pool = KVPool(
            num_layers=layers,
            num_pages=num_pages,
            page_size=case.page_size,
            num_kv_heads=2,
            head_dim=8,
            dtype=dtype,
            device=torch.device("cpu"),
        )
        if seed is not None:
            g = torch.Generator().manual_seed(seed + i)
            pool.storage.copy_(torch.randn(pool.storage.shape, generator=g).to(dtype))
        result.append(pool)
    return result


def record(case: Case) -> MetadataRecord:
    if not case.hidden:
        return MetadataRecord(first_token=11, cached_tokens=0)
    g = torch.Generator().manual_seed(case.room)
    return MetadataRecord(
        first_token=11,
        cached_tokens=0,
        first_logprob=-0.5,
        topk_p=torch.tensor([0.75, 0.25]),
        topk_index=torch.tensor([11, 4]),
        hidden_states=torch.randn(8, generator=g).to(torch.bfloat16),
    )


def run_prefill(cases, config: TransferConfig, port_queue, result_queue, behaviour="send"):
    """Serve every case's room: wait for decode's request, send KV and metadata."""
    from pdserve.transfer.prefill_side import PrefillTransferServer

    try:
        case0 = cases[0]
        server = PrefillTransferServer(config, layout(case0), metadata_spec(case0), "prefill-0")
        port_queue.put(server.start())
        for case in cases:
            sender = server.sender(case.room)
            wait_until(
                lambda s=sender: s.poll() is not TransferState.BOOTSTRAPPING,
                "decode's transfer request",
            )
            if sender.poll() is TransferState.FAILED:
                result_queue.put((case.room, "FAILED", _message(sender)))
                continue
            if behaviour == "partial":  # one piece of KV, then nothing: the test kills us
                _send_first_piece(case, sender)
                wait_until(lambda: False, "being killed", 60)
            if behaviour == "hold":  # never send: the test kills or aborts us
                wait_until(lambda s=sender: s.poll() is TransferState.FAILED, "the room to fail")
                result_queue.put((case.room, "FAILED", _message(sender)))
                continue
            kv = KVStager(pools(case, 20, seed=case.room)).gather(
                [list(case.prefill_pages)] + ([[1, 3]] if case.draft else [])
            )
            sender.send(kv, record(case))
            wait_until(
                lambda s=sender: s.poll() in (TransferState.SUCCESS, TransferState.FAILED),
                "the decode ack",
            )
            result_queue.put((case.room, sender.poll().name, _message(sender)))
        result_queue.put(("malformed", server.metrics.malformed_messages, None))
        server.stop()
    except Exception:
        result_queue.put(("error", traceback.format_exc(), None))


def _message(room) -> str | None:
    return room.failure.message if room.failure is not None else None


def _send_first_piece(case: Case, sender) -> None:
    """The room's first page, as a piece of its own (more would follow)."""
    from pdserve.transfer.kv_piece import OutgoingPiece, PageSpan

    stager = KVStager(pools(case, 20, seed=case.room))
    first = [case.prefill_pages[0]]
    sender.send_piece(OutgoingPiece(PageSpan(0, 1), stager.gather([first] * len(stager.pools))))


def run_decode(
    cases,
    config: TransferConfig,
    port: int,
    result_queue,
    layout_changes=None,
    abort_after_request=False,
    report_first_piece=False,
):
    """Receive every case's room into other page ids and check it bit for bit.
    report_first_piece: put `(room, "TRANSFERRING", None, seconds)` on the queue once the
    room's first piece came (a test acts mid-transfer then), before its final result."""
    from pdserve.transfer.decode_side import DecodeTransferClient

    try:
        case0 = cases[0]
        target = pools(case0, 30, seed=None)
        stager = KVStager(target)
        client = DecodeTransferClient(
            config,
            layout(case0, **(layout_changes or {})),
            metadata_spec(case0),
            f"decode-{os.getpid()}",
            stager.page_bytes,
        )
        client.start()
        for case in cases:
            draft_pages = [4, 10] if case.draft else []
            started = time.monotonic()
            receiver = client.receiver(
                case.room, "127.0.0.1", port, list(case.decode_pages), draft_pages
            )
            if abort_after_request:
                time.sleep(0.2)  # let the request reach prefill first
                receiver.abort(FailureKind.ABORTED, "client went away")
                result_queue.put((case.room, "ABORTED", None))
                continue
            if report_first_piece:
                wait_until(
                    lambda r=receiver: r.poll() is not TransferState.BOOTSTRAPPING,
                    "the room's first piece",
                )
                state = receiver.poll().name
                result_queue.put((case.room, state, None, time.monotonic() - started))
            wait_until(
                lambda r=receiver: r.poll() in (TransferState.SUCCESS, TransferState.FAILED),
                "the room to finish",
            )
            elapsed = time.monotonic() - started
            if receiver.poll() is TransferState.FAILED:
                result_queue.put((case.room, "FAILED", _message(receiver), elapsed))
                continue
            meta = receiver.commit(stager)
            source = pools(case, 20, seed=case.room)
            exact = all(
                torch.equal(src.storage[:, :, list(sp)], dst.storage[:, :, list(dp)])
                for src, dst, sp, dp in zip(
                    source,
                    target,
                    [case.prefill_pages, (1, 3)],
                    [case.decode_pages, draft_pages],
                    strict=False,
                )
            )
            expected = record(case)
            meta_ok = meta.first_token == expected.first_token and all(
                (a is None and b is None) or torch.equal(a, b)
                for a, b in (
                    (meta.hidden_states, expected.hidden_states),
                    (meta.topk_p, expected.topk_p),
                    (meta.topk_index, expected.topk_index),
                )
            )
            result_queue.put((case.room, "SUCCESS", (exact, meta_ok), elapsed))
            for pool in target:
                pool.storage.zero_()
        client.stop()
    except Exception:
        result_queue.put(("error", traceback.format_exc(), None, 0.0))
