"""PNG plots of a benchmark: latency CDFs per run and, for a rate sweep, latency and
throughput against the rate.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot, no display, no global
state), so plotting works headless and in threads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pdserve.bench.runner import RunResult

CDF_PANELS = (
    ("ttft_s", "Time to first token (ms)"),
    ("tpot_s", "Time per output token (ms)"),
    ("itl_s", "Inter-token latency, chunk gaps (ms)"),
    ("e2e_s", "End-to-end latency (ms)"),
)


def write_plots(
    directory: Path, results: Sequence[RunResult], summaries: Sequence[dict[str, Any]]
) -> list[Path]:
    """latency_cdf.png always; sweep.png when there are several runs. Returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = [_save(latency_cdfs(results), directory / "latency_cdf.png")]
    if len(results) > 1:
        written.append(_save(sweep(results, summaries), directory / "sweep.png"))
    return written


def latency_cdfs(results: Sequence[RunResult]) -> Figure:
    figure = Figure(figsize=(11, 8), layout="constrained")
    for axes, (field, title) in zip(figure.subplots(2, 2).flat, CDF_PANELS, strict=True):
        for result in results:
            values = sorted(v * 1e3 for v in _values(result, field))
            if values:
                # The empirical CDF: 0 up to the smallest value, i/n from the i-th.
                fractions = [i / len(values) for i in range(len(values) + 1)]
                values.insert(0, values[0])
                axes.step(values, fractions, where="post", label=result.load.label)
        axes.set_title(title)
        axes.set_xlabel("ms")
        axes.set_ylabel("fraction of requests" if field != "itl_s" else "fraction of gaps")
        axes.set_ylim(0, 1.02)
        axes.grid(alpha=0.3)
        if axes.has_data():
            axes.legend(fontsize="small")
    return figure


def sweep(results: Sequence[RunResult], summaries: Sequence[dict[str, Any]]) -> Figure:
    """TPOT P50/P90 and throughput/goodput by run, the runs in sweep order (categorical x:
    an infinite rate has no place on a numeric axis)."""
    figure = Figure(figsize=(11, 4.5), layout="constrained")
    latency, throughput = figure.subplots(1, 2)
    labels = [_rate_label(r.load.request_rate) for r in results]
    positions = range(len(results))
    for stat, name, style in (("median", "P50", "o-"), ("p90", "P90", "s--")):
        values = [_nan_if_none(s["tpot_ms"][stat]) for s in summaries]
        latency.plot(positions, values, style, label=f"TPOT {name}")
    latency.set_ylabel("ms")
    latency.set_title("Time per output token")
    throughput.plot(
        positions, [s["request_throughput"] for s in summaries], "o-", label="throughput"
    )
    if any(s["goodput"] is not None for s in summaries):
        goodput = [_nan_if_none(s["goodput"]) for s in summaries]
        throughput.plot(positions, goodput, "s--", label="goodput (SLOs met)")
    throughput.set_ylabel("requests/s")
    throughput.set_title("Completed requests per second")
    for axes in (latency, throughput):
        axes.set_xticks(list(positions), labels)
        axes.set_xlabel("request rate (req/s)")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    return figure


def _values(result: RunResult, field: str) -> list[float]:
    done = [r for r in result.records if r.success]
    if field == "itl_s":
        return [gap for r in done for gap in r.itl_s]
    return [v for r in done if (v := getattr(r, field)) is not None]


def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value


def _save(figure: Figure, path: Path) -> Path:
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=100)
    return path
