"""Plot the decode kernel's achieved bandwidth from `attention.py --output FILE.json`
(needs matplotlib).

    python benchmarks/plot_attention.py benchmarks/results/attention_h100.json \\
        benchmarks/attention_decode_h100.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("png")
    args = parser.parse_args()
    with open(args.results) as results:
        report = json.load(results)
    shapes = sorted({case["shape"] for case in report["decode"]})
    figure, _ = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), sharey=True)
    for ax, shape in zip(figure.axes, shapes, strict=True):
        cases = [c for c in report["decode"] if c["shape"] == shape]
        for batch in sorted({c["batch"] for c in cases}):
            row = sorted((c for c in cases if c["batch"] == batch), key=lambda c: c["context"])
            default = [next(x for x in c["configs"] if x["config"] == "default") for c in row]
            ax.plot(
                [c["context"] for c in row],
                [d["pct_copy"] for d in default],
                marker="o",
                label=f"batch {batch}",
            )
        ax.axhline(70, color="grey", linestyle="--", linewidth=1, label="target 70%")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(f"paged decode, {shape} heads (bf16)")
        ax.grid(True, alpha=0.3)
    figure.axes[0].set_ylabel("% of HBM copy bandwidth")
    figure.axes[0].legend()
    copy = report["ceilings"]["copy_gb_per_s"]
    figure.suptitle(f"{report['device']}: copy ceiling {copy:,.0f} GB/s (read + write)")
    figure.tight_layout()
    figure.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
