"""Router bookkeeping: worker pools, policies, pairing, bootstrap fields. Torch-free."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from pdserve.router.pairing import ROOM_BITS, choose_pair, with_bootstrap
from pdserve.router.policies import LeastLoad, Random, RoundRobin, make_policy
from pdserve.router.workers import NoHealthyWorker, Role, Worker, WorkerPool, WorkersBusy


def pools(num_prefill=2, num_decode=2):
    prefill = WorkerPool(
        Role.PREFILL,
        [Worker(f"http://10.0.0.{i}:30000", Role.PREFILL, 8998) for i in range(num_prefill)],
    )
    decode = WorkerPool(
        Role.DECODE, [Worker(f"http://10.0.1.{i}:30000", Role.DECODE) for i in range(num_decode)]
    )
    return prefill, decode


def test_round_robin_cycles_through_healthy_workers():
    prefill, _ = pools(3)
    policy = RoundRobin()
    picks = [policy.choose(prefill.healthy()).url for _ in range(6)]
    assert picks == [w.url for w in prefill.workers] * 2


def test_unhealthy_workers_leave_rotation_and_come_back():
    prefill, _ = pools(2)
    first, second = prefill.workers
    assert prefill.mark(first, False, "connection refused")
    assert not prefill.mark(first, False, "again")
    assert prefill.healthy() == [second] and first.last_error == "again"
    assert prefill.mark(first, True)
    assert prefill.healthy() == [first, second] and first.last_error is None


def test_least_load_prefers_fewest_in_flight():
    _, decode = pools(num_decode=3)
    a, b, c = decode.workers
    for worker, load in ((a, 2), (b, 0), (c, 1)):
        for _ in range(load):
            decode.acquire(worker)
    assert LeastLoad().choose(decode.healthy()) is b
    decode.acquire(b)
    decode.acquire(b)
    assert LeastLoad().choose(decode.healthy()) is c
    decode.release(c)
    decode.release(c)  # never below zero
    assert c.in_flight == 0


def test_random_policy_is_seeded_and_spreads():
    prefill, _ = pools(4)

    def picks(seed):
        policy = Random(seed)
        return [policy.choose(prefill.healthy()).url for _ in range(400)]

    counts = Counter(picks(1))
    assert picks(1) == picks(1) != picks(2)
    assert len(counts) == 4 and min(counts.values()) > 50


def test_retry_avoids_the_failed_pair_when_it_can():
    prefill, decode = pools(2, 2)
    first = choose_pair(prefill, decode, RoundRobin(), RoundRobin())
    for _ in range(10):
        retry = choose_pair(prefill, decode, Random(0), Random(0), avoid=first)
        assert retry.prefill is not first.prefill and retry.decode is not first.decode
        assert retry.room != first.room
    lonely_p, lonely_d = pools(1, 1)
    only = choose_pair(lonely_p, lonely_d, RoundRobin(), RoundRobin())
    again = choose_pair(lonely_p, lonely_d, RoundRobin(), RoundRobin(), avoid=only)
    assert again.prefill is only.prefill  # nothing else left: same worker, new room


def test_no_healthy_worker_is_a_clear_error():
    prefill, decode = pools(1, 1)
    prefill.mark(prefill.workers[0], False, "down")
    with pytest.raises(NoHealthyWorker, match="prefill"):
        choose_pair(prefill, decode, RoundRobin(), RoundRobin())


def test_a_bound_on_requests_in_flight_skips_full_workers_then_says_busy():
    prefill, decode = pools(2, 1)
    first, second = prefill.workers
    prefill.acquire(first)
    for _ in range(3):
        pair = choose_pair(prefill, decode, RoundRobin(), RoundRobin(), max_in_flight=1)
        assert pair.prefill is second
    prefill.acquire(second)
    with pytest.raises(WorkersBusy, match="all 2 prefill worker"):
        choose_pair(prefill, decode, RoundRobin(), RoundRobin(), max_in_flight=1)
    assert choose_pair(prefill, decode, RoundRobin(), RoundRobin(), max_in_flight=0)


def test_bootstrap_fields_name_the_prefill_worker_and_a_63_bit_room():
    prefill, decode = pools(1, 1)
    pair = choose_pair(prefill, decode, RoundRobin(), RoundRobin())
    body = with_bootstrap({"prompt": "hi", "max_tokens": 3}, pair)
    assert body["bootstrap_host"] == "10.0.0.0" and body["bootstrap_port"] == 8998
    assert 0 <= body["bootstrap_room"] < 2**ROOM_BITS
    assert body["prompt"] == "hi"
    rooms = {choose_pair(prefill, decode, RoundRobin(), RoundRobin()).room for _ in range(100)}
    assert len(rooms) == 100


def test_bootstrap_host_of_ipv6_and_named_urls():
    assert Worker("http://[::1]:30000", Role.PREFILL, 1).bootstrap_host == "::1"
    assert Worker("http://prefill-0.svc:8000", Role.PREFILL, 1).bootstrap_host == "prefill-0.svc"


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ValueError, match="round_robin, random, least_load"):
        make_policy("fastest")


def test_router_package_does_not_import_torch():
    code = (
        "import sys, pdserve.router.pairing, pdserve.router.policies, "
        "pdserve.router.workers; sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
