"""Plot decode tok/s per sequence against batch size from one or more
`latency.py --output FILE.json` (needs matplotlib).

One color per results file (a preset); pdserve engines are lines over batch size, transformers'
static-cache `generate` is a star at each batch size it ran, with its batch-1 figure drawn
across as a dotted reference.

    python benchmarks/plot_latency.py benchmarks/results/latency_llama1b_h100.json \\
        benchmarks/results/latency_llama8b_h100.json benchmarks/latency_h100.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

LINE_STYLES = ["-", "--", "-.", (0, (5, 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="latency.py JSON files")
    parser.add_argument("png")
    args = parser.parse_args()
    reports = []
    for path in args.results:
        with open(path) as results:
            reports.append(json.load(results))

    figure, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for report, color in zip(reports, colors, strict=False):
        plot_report(ax, report, color)
    batches = sorted({r["batch"] for report in reports for r in report["results"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(batch) for batch in batches])
    ax.set_xlabel("batch size (sequences)")
    ax.set_ylabel("decode tok/s per sequence")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    first = reports[0]
    ax.set_title(
        f"{first['device']}: prompt {first['prompt_len']}, {first['new_tokens']} new tokens, greedy"
    )
    figure.tight_layout()
    figure.savefig(args.png, dpi=110)


def plot_report(ax, report: dict, color: str) -> None:
    model = report["model"]
    pdserve_engines = sorted({r["engine"] for r in report["results"]} - {"transformers"})
    for engine, style in zip(pdserve_engines, LINE_STYLES, strict=False):
        rows = sorted((r for r in report["results"] if r["engine"] == engine), key=batch_of)
        eager = ", no CUDA graphs" if rows[0]["engine_options"].get("disable_cuda_graph") else ""
        ax.plot(
            [r["batch"] for r in rows],
            [r["decode_tokens_per_s_per_seq"] for r in rows],
            color=color,
            linestyle=style,
            marker="o",
            label=f"{model}: {engine} ({rows[0]['attention']}{eager})",
        )
    baseline = sorted((r for r in report["results"] if r["engine"] == "transformers"), key=batch_of)
    if not baseline:
        return
    compiled = "compiled" if baseline[0]["compiled"] else "eager"
    ax.plot(
        [r["batch"] for r in baseline],
        [r["decode_tokens_per_s_per_seq"] for r in baseline],
        color=color,
        linestyle="none",
        marker="*",
        markersize=12,
        label=f"{model}: transformers static cache ({compiled})",
    )
    at_batch1 = [r for r in baseline if r["batch"] == 1]
    if at_batch1:
        ax.axhline(
            at_batch1[0]["decode_tokens_per_s_per_seq"], color=color, linestyle=":", linewidth=1
        )


def batch_of(result: dict) -> int:
    return result["batch"]


if __name__ == "__main__":
    main()
