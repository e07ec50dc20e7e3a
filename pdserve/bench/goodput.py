"""Goodput over a rate sweep: the highest offered rate at which a deployment still serves
almost every request within its latency SLOs.

- A request is within SLO when the judge says so (`SLO.met`, or a judge per request class):
  it succeeded and met every objective.
- A run's attainment is the fraction of the requests it sent that are within SLO; failed
  requests, those cut off at the run's deadline included, count against it.
- A run meets the SLOs when its attainment is at least the target, 90% unless told.
- A sweep's goodput is the highest swept rate that meets the SLOs with every lower swept
  rate meeting them too; None when the lowest rate misses. (A pass above a miss is noise or
  a sweep out of order, not capacity.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from pdserve.bench.client import RequestRecord
from pdserve.bench.metrics import SLO

ATTAINMENT_TARGET = 0.9


def attainment(records: Sequence[RequestRecord], within: Callable[[RequestRecord], bool]) -> float:
    """The fraction of `records` (every request sent, failed ones too) that `within` accepts."""
    if not records:
        raise ValueError("attainment of a run that sent no request is undefined")
    return sum(bool(within(record)) for record in records) / len(records)


def meets(fraction: float, target: float = ATTAINMENT_TARGET) -> bool:
    return fraction >= target


def sweep_goodput(
    points: Iterable[tuple[float, float]], target: float = ATTAINMENT_TARGET
) -> float | None:
    """The goodput of a sweep given as (rate, attainment) pairs, in any order: the highest
    rate that meets `target` with every lower rate meeting it too; None if the lowest misses."""
    goodput = None
    for rate, fraction in sorted(points):
        if not meets(fraction, target):
            break
        goodput = rate
    return goodput


def slo_horizon_s(slo: SLO, max_output_tokens: int) -> float | None:
    """How long after it was sent a request of at most `max_output_tokens` tokens can still
    be running and end within `slo`; None when the SLO bounds no request's duration.

    Within SLO, a request of n tokens ends at TTFT + (n - 1) x TPOT <= TTFT SLO + (n - 1) x
    TPOT SLO, and by the E2E SLO. So one still running past the horizon misses it whatever
    happens next: a run can stop waiting for it without changing its attainment."""
    if max_output_tokens < 1:
        raise ValueError(f"max output tokens {max_output_tokens}: must be >= 1")
    bounds = []
    if slo.ttft_ms is not None and (slo.tpot_ms is not None or max_output_tokens == 1):
        bounds.append((slo.ttft_ms + (max_output_tokens - 1) * (slo.tpot_ms or 0.0)) / 1e3)
    if slo.e2e_ms is not None:
        bounds.append(slo.e2e_ms / 1e3)
    return min(bounds) if bounds else None
