"""pdserve.bench.goodput: SLO attainment, a sweep's goodput and how long a run must wait for
a request that can still meet its SLO (expected values worked out in the comments)."""

from __future__ import annotations

import pytest

from pdserve.bench.client import RequestRecord
from pdserve.bench.goodput import attainment, meets, slo_horizon_s, sweep_goodput
from pdserve.bench.metrics import SLO


def done(ttft: float, e2e: float, tokens: int) -> RequestRecord:
    return RequestRecord(success=True, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens)


def failed() -> RequestRecord:
    return RequestRecord(success=False, error="cut off", ttft_s=0.01, e2e_s=0.02)


def test_attainment_counts_failed_requests_against_the_run():
    slo = SLO(ttft_ms=200, tpot_ms=50)
    records = [
        done(0.1, 0.46, 10),  # ttft 100 ms, tpot 360 / 9 = 40 ms: within
        done(0.3, 0.4, 3),  # ttft 300 ms: misses
        done(0.1, 1.0, 10),  # tpot 100 ms: misses
        failed(),  # fast, but failed
    ]
    assert attainment(records, slo.met) == pytest.approx(1 / 4)
    assert attainment(records, lambda r: r.success) == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="no request"):
        attainment([], slo.met)


def test_a_run_meets_at_ninety_percent_unless_told():
    assert meets(0.9) and not meets(0.89)
    assert meets(0.5, target=0.5) and not meets(0.49, target=0.5)


def test_goodput_is_the_highest_rate_whose_lower_rates_all_meet():
    assert sweep_goodput([(1, 1.0), (2, 0.95), (4, 0.9), (8, 0.5)]) == 4
    assert sweep_goodput([(8, 0.5), (2, 0.95), (1, 1.0), (4, 0.9)]) == 4  # any order
    assert sweep_goodput([(1, 1.0), (2, 0.8), (4, 0.95)]) == 1  # a pass above a miss: noise
    assert sweep_goodput([(1, 0.5), (2, 1.0)]) is None
    assert sweep_goodput([(1, 1.0), (2, 1.0)]) == 2  # the sweep never reached the limit
    assert sweep_goodput([]) is None
    assert sweep_goodput([(1, 0.6), (2, 0.55)], target=0.5) == 2


def test_the_horizon_is_the_latest_end_a_request_within_slo_can_have():
    # 2000 ms to the first token, then 99 more tokens at 50 ms: 2 + 4.95 s.
    assert slo_horizon_s(SLO(ttft_ms=2000, tpot_ms=50), 100) == pytest.approx(6.95)
    # An E2E objective tighter than that bounds it; a looser one does not.
    assert slo_horizon_s(SLO(ttft_ms=2000, tpot_ms=50, e2e_ms=3000), 100) == pytest.approx(3.0)
    assert slo_horizon_s(SLO(ttft_ms=2000, tpot_ms=50, e2e_ms=9000), 100) == pytest.approx(6.95)
    assert slo_horizon_s(SLO(ttft_ms=300), 1) == pytest.approx(0.3)  # one token: no TPOT
    assert slo_horizon_s(SLO(ttft_ms=300), 2) is None  # TPOT unbounded
    assert slo_horizon_s(SLO(tpot_ms=50), 100) is None  # TTFT unbounded
    with pytest.raises(ValueError, match="max output tokens"):
        slo_horizon_s(SLO(ttft_ms=1), 0)


def test_a_request_still_running_past_the_horizon_cannot_be_within_slo():
    slo = SLO(ttft_ms=200, tpot_ms=50)
    horizon = slo_horizon_s(slo, 10)  # 0.2 + 9 * 0.05 = 0.65 s
    for ttft in (0.05, 0.2, 0.3, 0.6):
        assert not slo.met(done(ttft, horizon + 0.01, 10))
        assert not slo.met(done(ttft, horizon + 0.01, 5))  # fewer tokens end sooner still
    assert slo.met(done(0.2, horizon - 1e-9, 10))
