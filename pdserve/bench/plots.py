"""PNG plots of a benchmark: latency CDFs per run and, for a rate sweep, latency (TTFT and
TPOT) and throughput against the rate. Every figure's title names the server, the model and
the workload; inter-token gaps span orders of magnitude (a batch's stall beside sub-ms
chunks), so their CDF has a log axis.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot, no display, no global
state), so plotting works headless and in threads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
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

LOG_AXIS = ("itl_s",)


@dataclass(frozen=True)
class PlotTitle:
    """What was measured: the server's URL, the model and the workload in a few words."""

    server: str
    model: str
    workload: str

    def __str__(self) -> str:
        return f"{self.model} on {self.server}\n{self.workload}"


def write_plots(
    directory: Path,
    results: Sequence[RunResult],
    summaries: Sequence[dict[str, Any]],
    title: PlotTitle,
) -> list[Path]:
    """latency_cdf.png always; sweep.png when there are several runs. Returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = [_save(latency_cdfs(results, title), directory / "latency_cdf.png")]
    if len(results) > 1:
        written.append(_save(sweep(results, summaries, title), directory / "sweep.png"))
    return written


def latency_cdfs(results: Sequence[RunResult], title: PlotTitle) -> Figure:
    figure = Figure(figsize=(11, 8.5), layout="constrained")
    figure.suptitle(str(title))
    for axes, (field, panel) in zip(figure.subplots(2, 2).flat, CDF_PANELS, strict=True):
        for result in results:
            values = sorted(v * 1e3 for v in _values(result, field))
            if field in LOG_AXIS:
                values = [v for v in values if v > 0]  # NOTE: no place on a log axis
            if values:
                # The empirical CDF: 0 up to the smallest value, i/n from the i-th.
                fractions = [i / len(values) for i in range(len(values) + 1)]
                values.insert(0, values[0])
                axes.step(values, fractions, where="post", label=result.load.label)
        axes.set_title(panel)
        axes.set_xlabel("ms (log scale)" if field in LOG_AXIS else "ms")
        if field in LOG_AXIS and axes.has_data():
            axes.set_xscale("log")
        axes.set_ylabel("fraction of requests" if field != "itl_s" else "fraction of gaps")
        axes.set_ylim(0, 1.02)
        axes.grid(alpha=0.3)
        if axes.has_data():
            axes.legend(fontsize="small")
    return figure


def sweep(
    results: Sequence[RunResult], summaries: Sequence[dict[str, Any]], title: PlotTitle
) -> Figure:
    """TTFT and TPOT P50/P90 and throughput/goodput by run, the runs in sweep order
    (categorical x: an infinite rate has no place on a numeric axis)."""
    figure = Figure(figsize=(15, 4.8), layout="constrained")
    figure.suptitle(str(title))
    ttft, tpot, throughput = figure.subplots(1, 3)
    labels = [_rate_label(r.load.request_rate) for r in results]
    positions = range(len(results))
    for axes, key, name in (
        (ttft, "ttft_ms", "Time to first token"),
        (tpot, "tpot_ms", "Time per output token"),
    ):
        short = key.removesuffix("_ms").upper()
        for stat, label, style in (("median", "P50", "o-"), ("p90", "P90", "s--")):
            values = [_nan_if_none(s[key][stat]) for s in summaries]
            axes.plot(positions, values, style, label=f"{short} {label}")
        axes.set_ylabel("ms")
        axes.set_title(name)
    throughput.plot(
        positions, [s["request_throughput"] for s in summaries], "o-", label="throughput"
    )
    if any(s["goodput"] is not None for s in summaries):
        goodput = [_nan_if_none(s["goodput"]) for s in summaries]
        throughput.plot(positions, goodput, "s--", label="goodput (SLOs met)")
    throughput.set_ylabel("requests/s")
    throughput.set_title("Completed requests per second")
    for axes in (ttft, tpot, throughput):
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
