"""A run's summary: latency percentiles, throughput and goodput.

- Percentiles interpolate linearly between closest ranks (`percentile`), as numpy's default
  and `statistics.quantiles(method="inclusive")` do.
- Latencies (TTFT, TPOT, ITL, E2E) are over successful requests; ITL pools every gap between
  output-carrying chunks of every successful request (client.py says what a chunk gap is).
- Throughputs count successful requests and their tokens over the run's duration; input
  tokens are those the server's usage reported (or the token-id prompt's length).
- Goodput is successful requests per second that meet every SLO given (TTFT, TPOT, E2E, any
  subset); with no SLO given it is not reported (None). A request with one output token has
  no TPOT and meets any TPOT SLO.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.bench.client import RequestRecord

PERCENTILES = (50, 90, 99)
ERRORS_KEPT = 5


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0 <= p <= 100) by linear interpolation: with the values sorted
    as x[0..n-1], rank h = (n - 1) * p / 100 gives x[floor h] + (h - floor h) *
    (x[floor h + 1] - x[floor h]). None for no values."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p}: must be within [0, 100]")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (rank - below) * (ordered[above] - ordered[below])


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean, median, P90 and P99 in milliseconds of values in seconds (None when empty)."""
    ms = [v * 1e3 for v in values_s]
    stats: dict[str, float | None] = {"mean": statistics.fmean(ms) if ms else None}
    for p in PERCENTILES:
        stats["median" if p == 50 else f"p{p}"] = percentile(ms, p)
    return stats


@dataclass(frozen=True)
class SLO:
    """Latency objectives in milliseconds; None: not an objective."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name.removesuffix('_ms')} {value} ms: must be > 0")

    @property
    def given(self) -> bool:
        return any(value is not None for value in asdict(self).values())

    def met(self, record: RequestRecord) -> bool:
        if not record.success:
            return False
        if self.ttft_ms is not None and not _within(record.ttft_s, self.ttft_ms):
            return False
        tpot = record.tpot_s
        if self.tpot_ms is not None and tpot is not None and not _within(tpot, self.tpot_ms):
            return False
        return self.e2e_ms is None or _within(record.e2e_s, self.e2e_ms)


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> dict[str, Any]:
    done = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    reported = [r for r in done if r.cached_tokens is not None]
    cached_tokens = sum(r.cached_tokens for r in reported) if reported else None

    def per_second(amount: float) -> float:
        return amount / duration_s if duration_s > 0 else 0.0

    return {
        "completed": len(done),
        "failed": len(failed),
        "duration_s": duration_s,
        "input_tokens": input_tokens,
        # prompt tokens served from the server's prefix cache, and what was left to compute
        "cached_input_tokens": cached_tokens,
        "computed_input_tokens": None if cached_tokens is None else input_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "request_throughput": per_second(len(done)),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
        "goodput": per_second(sum(slo.met(r) for r in done)) if slo.given else None,
        "ttft_ms": distribution_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in done if r.e2e_s is not None]),
        "errors": [
            {"conversation": r.conversation, "turn": r.turn, "error": r.error}
            for r in failed[:ERRORS_KEPT]
        ],
    }


def format_summary(summary: dict[str, Any], title: str) -> str:
    """The summary as a table for a terminal."""
    width = 58
    lines = [f" {title} ".center(width, "=")]

    def row(name: str, value: Any, unit: str = "") -> None:
        if isinstance(value, float):
            value = f"{value:.2f}"
        elif value is None:
            value = "-"
        lines.append(f"{name + (f' ({unit})' if unit else '') + ':':<40}{value:>18}")

    row("Successful requests", summary["completed"])
    row("Failed requests", summary["failed"])
    row("Duration", summary["duration_s"], "s")
    row("Input tokens", summary["input_tokens"])
    if summary.get("cached_input_tokens") is not None:
        row("Input tokens from the prefix cache", summary["cached_input_tokens"])
    row("Output tokens", summary["output_tokens"])
    row("Request throughput", summary["request_throughput"], "req/s")
    if summary["goodput"] is not None:
        row("Goodput", summary["goodput"], "req/s")
    row("Output token throughput", summary["output_throughput"], "tok/s")
    row("Total token throughput", summary["total_token_throughput"], "tok/s")
    for key, name in (
        ("ttft_ms", "Time to first token"),
        ("tpot_ms", "Time per output token (excl. 1st)"),
        ("itl_ms", "Inter-token latency (chunk gaps)"),
        ("e2e_ms", "End-to-end latency"),
    ):
        lines.append(f" {name} ".center(width, "-"))
        for stat, value in summary[key].items():
            row(stat.capitalize() if stat in ("mean", "median") else stat.upper(), value, "ms")
    for failure in summary["errors"]:
        where = f"conversation {failure['conversation']}, turn {failure['turn']}"
        lines.append(f"failed ({where}): {failure['error']}")
    lines.append("=" * width)
    return "\n".join(lines)


def _within(seconds: float | None, limit_ms: float) -> bool:
    return seconds is not None and seconds * 1e3 <= limit_ms
