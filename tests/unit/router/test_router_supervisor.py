"""`router/processes.py` in this process: the supervisor forks a process a socket, replaces
one that dies, and gives up (exit 1) on one that fails while starting or on too many
restarts; and `RouterConfig`'s limits for several processes. The real router with several
processes: tests/e2e/test_router_processes.py."""

from __future__ import annotations

import os
import signal

import pytest

from pdserve.router import processes
from pdserve.router.config import RouterConfig
from pdserve.router.processes import Supervisor, bind_sockets

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


WORKERS = ("http://127.0.0.1:9",)


def test_the_sockets_share_one_port():
    sockets = bind_sockets("127.0.0.1", 0, 3)
    try:
        assert len({s.getsockname()[1] for s in sockets}) == 1
    finally:
        for s in sockets:
            s.close()


def _supervise(serve, count=1) -> tuple[int, list[int]]:
    ended: list[int] = []
    sockets = bind_sockets("127.0.0.1", 0, count)
    return Supervisor(sockets, serve, 1.0, ended.append).run(), ended


def test_a_process_that_fails_while_starting_stops_the_router():
    code, ended = _supervise(lambda sock: 3)
    assert code == 1
    assert len(ended) == 1, "the failed process is reported ended (its metrics marked dead)"


def test_a_killed_process_is_replaced_until_too_many_restarts(monkeypatch):
    monkeypatch.setattr(processes, "RESTARTS_PER_MINUTE", 3)

    def die(sock) -> int:
        os.kill(os.getpid(), signal.SIGKILL)
        return 0

    code, ended = _supervise(die)
    assert code == 1
    assert len(ended) == 4, "the first process and three replacements"
    assert len(set(ended)) == 4


def test_a_stop_signal_ends_every_process():
    parent = os.getpid()

    def serve(sock) -> int:
        os.kill(parent, signal.SIGTERM)  # NOTE: as an operator would, once we run
        signal.pause()  # until the supervisor stops us
        return 0

    code, ended = _supervise(serve, count=2)
    assert code == 0
    assert len(ended) == 2


def test_several_processes_refuse_cache_aware_routing():
    with pytest.raises(ValueError, match="cache_aware"):
        RouterConfig(worker_urls=WORKERS, policy="cache_aware", router_processes=2)
    RouterConfig(worker_urls=WORKERS, policy="cache_aware", router_processes=1)


def test_the_in_flight_bound_is_split_among_the_processes():
    with pytest.raises(ValueError, match="at least one per process"):
        RouterConfig(worker_urls=WORKERS, router_processes=4, max_requests_per_worker=3)
    config = RouterConfig(worker_urls=WORKERS, router_processes=4, max_requests_per_worker=10)
    assert config.per_process().max_requests_per_worker == 2
    unbounded = RouterConfig(worker_urls=WORKERS, router_processes=4)
    assert unbounded.per_process().max_requests_per_worker == 0


@pytest.mark.parametrize("count", [0, 65])
def test_a_process_count_out_of_range_is_refused(count):
    with pytest.raises(ValueError, match="--router-processes"):
        RouterConfig(worker_urls=WORKERS, router_processes=count)
