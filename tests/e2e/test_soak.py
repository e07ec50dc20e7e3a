"""The soak (tests/e2e/soak.py) at CI size: mixed requests with random aborts and invalid
bodies through `pdserve launch` while a prefill and a decode worker are killed and restarted;
no 5xx outside the restarts, no request past its deadline, every page free at the end, RSS
bounded. `PDSERVE_SOAK_REQUESTS` sets the size (the full soak: 10,000)."""

from __future__ import annotations

import os

from tests.e2e.soak import run_soak


def test_soak_with_two_worker_restarts(tiny_model_dirs):
    num_requests = int(os.environ.get("PDSERVE_SOAK_REQUESTS", "500"))
    report = run_soak(tiny_model_dirs("llama"), num_requests)
    print(report.summary())
    assert report.restarts == 2
    assert report.outcomes["ok"] > num_requests // 2
    assert report.outcomes["rejected"] > 0 and report.outcomes["aborted"] > 0
    assert report.passed, report.summary()
