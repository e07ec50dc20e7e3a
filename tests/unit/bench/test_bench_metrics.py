"""pdserve.bench.metrics: percentiles, SLOs, goodput and the summary, on inputs small enough
to check by hand (expected values are worked out in the comments, not read off the code)."""

from __future__ import annotations

import random
import statistics

import pytest

from pdserve.bench.client import RequestRecord
from pdserve.bench.metrics import SLO, distribution_ms, format_summary, percentile, summarize


def test_percentile_interpolates_between_closest_ranks():
    values = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4, ranks 0..3
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)  # rank 1.5: halfway from 2 to 3
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile([10.0, 20.0], 25) == pytest.approx(12.5)  # rank 0.25


def test_percentile_of_one_value_and_of_none():
    assert percentile([7.0], 0) == percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="within"):
        percentile([1.0], 101)


def test_percentile_agrees_with_statistics_inclusive_quantiles():
    rng = random.Random(3)
    values = [rng.expovariate(1.0) for _ in range(101)]
    cuts = statistics.quantiles(values, n=100, method="inclusive")  # cuts[k - 1] is P_k
    for p in (1, 10, 50, 90, 99):
        assert percentile(values, p) == pytest.approx(cuts[p - 1])


def test_distribution_is_in_milliseconds():
    stats = distribution_ms([0.001, 0.002, 0.003])
    assert stats == pytest.approx({"mean": 2.0, "median": 2.0, "p90": 2.8, "p99": 2.98})
    assert distribution_ms([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def done(ttft: float, e2e: float, tokens: int, prompt: int = 5, itl=()) -> RequestRecord:
    return RequestRecord(
        success=True,
        ttft_s=ttft,
        e2e_s=e2e,
        output_tokens=tokens,
        prompt_tokens=prompt,
        itl_s=list(itl),
    )


def failed(message: str = "HTTP 503: busy") -> RequestRecord:
    return RequestRecord(success=False, error=message, ttft_s=0.001, e2e_s=0.001)


def test_tpot_leaves_out_the_first_token():
    assert done(0.2, 1.2, 11).tpot_s == pytest.approx(0.1)  # 1.0 s over 10 later tokens
    assert done(0.2, 0.2, 1).tpot_s is None
    assert failed().tpot_s is None


def test_goodput_counts_requests_meeting_every_given_slo():
    records = [
        done(0.1, 1.1, 11),  # ttft 100 ms, tpot 100 ms, e2e 1100 ms
        done(0.3, 0.8, 6),  # ttft 300 ms, tpot 100 ms, e2e 800 ms
        done(0.1, 2.1, 11),  # ttft 100 ms, tpot 200 ms, e2e 2100 ms
        done(0.1, 0.1, 1),  # one token: no tpot
        failed(),
    ]
    duration = 2.0
    assert summarize(records, duration, SLO())["goodput"] is None
    # ttft <= 200 ms: requests 1, 3, 4 -> 3 over 2 s
    assert summarize(records, duration, SLO(ttft_ms=200))["goodput"] == pytest.approx(1.5)
    # and tpot <= 150 ms: 3 fails; 4 has no tpot and meets it -> 2 over 2 s
    both = SLO(ttft_ms=200, tpot_ms=150)
    assert summarize(records, duration, both)["goodput"] == pytest.approx(1.0)
    # e2e <= 1000 ms: requests 2 and 4
    assert summarize(records, duration, SLO(e2e_ms=1000))["goodput"] == pytest.approx(1.0)


def test_slo_limits_are_inclusive_and_must_be_positive():
    assert SLO(ttft_ms=100).met(done(0.1, 0.5, 2))
    with pytest.raises(ValueError, match="ttft"):
        SLO(ttft_ms=0)


def test_summary_counts_throughput_over_successful_requests():
    records = [
        done(0.1, 1.0, 10, prompt=5, itl=[0.1, 0.2]),
        done(0.2, 1.0, 20, prompt=5, itl=[0.3]),
        done(0.3, 1.0, 30, prompt=5),
        failed("HTTP 400: too long"),
    ]
    summary = summarize(records, 2.0, SLO())
    assert (summary["completed"], summary["failed"]) == (3, 1)
    assert summary["request_throughput"] == pytest.approx(1.5)  # 3 requests / 2 s
    assert summary["output_throughput"] == pytest.approx(30.0)  # 60 tokens / 2 s
    assert summary["total_token_throughput"] == pytest.approx(37.5)  # (15 + 60) / 2 s
    assert summary["ttft_ms"]["median"] == pytest.approx(200.0)  # the failure's 1 ms is out
    assert summary["itl_ms"]["median"] == pytest.approx(200.0)  # pooled gaps 100, 200, 300
    assert summary["errors"] == [{"conversation": 0, "turn": 0, "error": "HTTP 400: too long"}]


def test_summary_keeps_only_the_first_failures():
    summary = summarize([failed(f"error {i}") for i in range(12)], 1.0, SLO())
    assert [e["error"] for e in summary["errors"]] == [f"error {i}" for i in range(5)]
    assert summary["ttft_ms"]["median"] is None
    assert summary["request_throughput"] == 0.0


def test_table_shows_goodput_only_with_an_slo():
    records = [done(0.1, 1.0, 10)]
    assert "Goodput" not in format_summary(summarize(records, 1.0, SLO()), "run")
    table = format_summary(summarize(records, 1.0, SLO(ttft_ms=50)), "run")
    assert "Goodput (req/s):" in table and table.count("\n") > 20
