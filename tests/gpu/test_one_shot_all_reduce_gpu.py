"""The one-shot all-reduce kernel on two GPUs (`kernels/one_shot_all_reduce.py`): its sums
equal NCCL's, its fused residual add + RMSNorm equals the sum followed by the norm kernel,
bit for bit, eagerly and replayed from a CUDA graph of many calls back to back (a rank
rewriting a slot another still reads shows there); and a rank left waiting for a peer that
never comes traps instead of summing what is there."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu

SIZE = 2
HIDDEN = 4096
EPS = 1e-5
ROWS = (1, 8, 64, 128)
GRAPH_CALLS = 65


def _open(rank: int, port: int):
    from pdserve.engine.parallel.process_groups import open_group
    from pdserve.engine.parallel.symmetric_all_reduce import SymmetricAllReduce

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, SIZE, rank == 0)
    group = open_group(store, rank, SIZE, device, timeout_s=60)
    reducer = SymmetricAllReduce.open(group, store, rank, SIZE, device, torch.bfloat16)
    return device, group, reducer


def _inputs(device, rank: int, call: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, HIDDEN, device=device, generator=_seeded(device, 7919 * call + rank))
    # NOTE: the residual stream is the same on every rank, as in a model
    residual = torch.randn(rows, HIDDEN, device=device, generator=_seeded(device, call))
    return x.to(torch.bfloat16), residual.to(torch.bfloat16)


def _seeded(device, seed: int) -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


def _compare(rank: int, port: int, results, release) -> None:
    from pdserve.engine.kernels.norm import rms_norm

    device, group, reducer = _open(rank, port)
    failures = []
    if reducer is None:
        results.put((rank, ["the one-shot all-reduce did not open"]))
        return
    weight = torch.rand(HIDDEN, device=device, generator=_seeded(device, 3)).to(torch.bfloat16)
    plan = [(call, ROWS[call % len(ROWS)]) for call in range(GRAPH_CALLS)]
    inputs = {call: _inputs(device, rank, call, rows) for call, rows in plan}
    expected = {}
    for call, (x, residual) in inputs.items():
        total = x.clone()
        group.allreduce([total]).wait()
        expected[call] = (total, *rms_norm(total, weight, EPS, residual.clone()))

    def run_all():
        outputs = {}
        for call, (x, residual) in inputs.items():
            if call % 2:
                outputs[call] = (reducer(x),)
            else:
                stream = residual.clone()
                outputs[call] = reducer.sum_and_norm(x, stream, weight, EPS)
        return outputs

    def check(outputs, how):
        for call, got in outputs.items():
            total, normed, stream = expected[call]
            want = (total,) if call % 2 else (normed, stream)
            if not all(torch.equal(g, w) for g, w in zip(got, want, strict=True)):
                failures.append(f"{how} call {call} ({len(total)} rows) differs")

    check(run_all(), "eager")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        captured = run_all()
    for replay in range(3):
        graph.replay()
        torch.cuda.synchronize(device)
        check(captured, f"replay {replay}")
    done = torch.zeros(1, device=device)
    group.allreduce([done]).wait()
    torch.cuda.synchronize(device)
    results.put((rank, failures))


def _stranded(rank: int, port: int, results, release) -> None:
    """One sum together (the kernel compiled and warm), then rank 0 sums alone (rank 1 never
    calls again) with a short wait: it must trap."""
    device, _, reducer = _open(rank, port)
    ones = torch.ones(1, HIDDEN, dtype=torch.bfloat16, device=device)
    reducer(ones)
    torch.cuda.synchronize(device)
    if rank == 1:
        release.wait(timeout=120)  # NOTE: stays mapped until rank 0 has its answer
        return
    reducer.max_spins = 200_000
    start = time.monotonic()
    try:
        reducer(ones)
        torch.cuda.synchronize(device)
        outcome = "returned"
    except RuntimeError as error:
        outcome = f"raised: {error}"
    results.put((outcome, time.monotonic() - start))


def _run_ranks(target, reports: int) -> list:
    """`reports` results of `target(rank, port, results, release)` run on each GPU."""
    from pdserve.server.local_process import free_port

    if torch.cuda.device_count() < SIZE:
        pytest.skip(f"needs {SIZE} GPUs")
    context = mp.get_context("spawn")
    results, release = context.Queue(), context.Event()
    port = free_port()
    procs = [context.Process(target=target, args=(r, port, results, release)) for r in range(SIZE)]
    for p in procs:
        p.start()
    try:
        return sorted(results.get(timeout=240) for _ in range(reports))
    finally:
        release.set()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def test_sums_and_fused_norms_equal_nccl_and_the_norm_kernel():
    for rank, failures in _run_ranks(_compare, SIZE):
        assert failures == [], f"rank {rank}: {failures}"


def test_a_rank_whose_peer_never_comes_traps():
    ((outcome, seconds),) = _run_ranks(_stranded, 1)
    assert outcome.startswith("raised"), f"a stranded wait {outcome} after {seconds:.2f} s"
    print(f"200k polls trapped after {seconds:.3f} s: {outcome}")
