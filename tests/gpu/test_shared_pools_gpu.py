"""A decode pool shared through CUDA IPC (`shared_pools`) between two processes
that each see only their own GPU, as `pdserve launch --gpus` starts workers: the prefill
process maps it onto its own device and `KVStager.write` copies pages into it exactly.
Needs two GPUs (nvidia-h200-x2)."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

PAGES, SRC_PAGES, DST_PAGES = 40, [3, 9, 1, 30], [0, 17, 5, 39]


def _pool(num_pages: int, seed: int | None):
    from pdserve.engine.runtime.kv_pool import KVPool

    pool = KVPool(
        num_layers=4,
        num_pages=num_pages,
        page_size=16,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        device=torch.device("cuda:0"),
    )
    if seed is not None:
        generator = torch.Generator("cuda:0").manual_seed(seed)
        pool.storage.copy_(torch.randn(pool.storage.shape, generator=generator, device="cuda:0"))
    return pool


def _decode(handles, orders, results) -> None:
    from pdserve.protocol.codec import encode
    from pdserve.transfer.backends.ipc.shared_pools import export_pool

    pool = _pool(PAGES, seed=None)
    handles.put(encode(export_pool(pool.storage)))  # as it travels in `Register`
    orders.get(timeout=120)  # the prefill process wrote
    results.put(pool.storage[:, :, DST_PAGES].float().cpu().numpy())
    orders.get(timeout=120)  # kept alive until the parent compared


def _prefill(handles, results) -> None:
    from pdserve.protocol.codec import decode
    from pdserve.protocol.transfer_messages import PoolHandle
    from pdserve.transfer.backends.ipc.shared_pools import open_pool
    from pdserve.transfer.kv_staging import KVStager

    pool = _pool(PAGES, seed=5)
    handle = decode(handles.get(timeout=120), PoolHandle)
    mapped = open_pool(handle, pool.storage, peer="decode", pid=0)  # NOTE: CUDA IPC names none
    KVStager([pool]).write([SRC_PAGES], [mapped], [DST_PAGES])
    torch.cuda.synchronize()
    # NOTE: numpy, sent by value: a tensor would be fetched from the process, which exits.
    results.put(pool.storage[:, :, SRC_PAGES].float().cpu().numpy())


def test_a_pool_shared_between_processes_that_see_one_gpu_each_takes_exact_writes():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")
    spawn = multiprocessing.get_context("spawn")
    handles, orders = spawn.Queue(), spawn.Queue()
    decode_results, prefill_results = spawn.Queue(), spawn.Queue()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        os.environ["CUDA_VISIBLE_DEVICES"] = "1"
        decode = spawn.Process(target=_decode, args=(handles, orders, decode_results))
        decode.start()
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
        prefill = spawn.Process(target=_prefill, args=(handles, prefill_results))
        prefill.start()
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    try:
        written = prefill_results.get(timeout=120)
        orders.put("written")
        received = decode_results.get(timeout=120)
        assert (received == written).all() and abs(written).sum() > 0
    finally:
        orders.put("done")
        prefill.join(30)
        decode.join(30)
