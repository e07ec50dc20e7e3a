"""pd_goodput.py's results as tables (terminal and Markdown) and PNG plots, all read from its
report (result.json); goodputs and the comparison are derived here (`finish_report`).

    python benchmarks/pd_goodput_report.py pd_goodput_out/result.json [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pdserve.bench.goodput import sweep_goodput

STYLE = {"disaggregated": ("tab:blue", "o-"), "colocated": ("tab:orange", "s--")}
COLUMNS = (
    "deployment",
    "rate",
    "requests",
    "cut off",
    "TTFT p50 / p99 ms",
    "TPOT p50 / p99 ms",
    "req/s",
    "out tok/s",
    "within SLO",
    "within SLO/s",
    "meets",
)


def finish_report(report: dict) -> None:
    """Add each sweep's goodput (overall and per TPOT SLO) and each workload's comparison."""
    target = report["attainment_target"]
    keys = [f"{tpot:g}" for tpot in report["tpot_slos_ms"]]
    for workload in report["workloads"].values():
        for result in workload["results"].values():
            runs = result["runs"]
            result["goodput"] = sweep_goodput(
                [(run["rate"], run["slo_attainment"]) for run in runs], target
            )
            result["goodput_by_tpot_slo"] = {
                key: sweep_goodput(
                    [(run["rate"], run["attainment_by_tpot_slo"][key]) for run in runs], target
                )
                for key in keys
            }
            # NOTE: when the highest rate swept still meets, the capacity lies above it.
            result["goodput_is_lower_bound"] = bool(runs) and result["goodput"] == max(
                workload["rates"]
            )
            result["rates_not_run"] = [
                rate for rate in workload["rates"] if rate not in {run["rate"] for run in runs}
            ]
        workload["comparison"] = _comparison(workload["results"], keys)


def _comparison(results: dict, keys: list[str]) -> dict | None:
    """Both deployments' goodput at the strictest TPOT SLO each one meets at some rate."""
    if not {"colocated", "disaggregated"} <= results.keys():
        return None
    tables = {name: results[name]["goodput_by_tpot_slo"] for name in ("colocated", "disaggregated")}
    comparison: dict = {"goodput": {name: results[name]["goodput"] for name in tables}}
    for name, table in tables.items():
        met = [key for key in keys if table[key] is not None]
        strictest = met[0] if met else None
        comparison[f"at_strictest_tpot_slo_{name}_meets"] = {
            "tpot_slo_ms": None if strictest is None else float(strictest),
            **{other: None if strictest is None else tables[other][strictest] for other in tables},
        }
    return comparison


def _number(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def _goodput(result: dict) -> str:
    if result["goodput"] is None:
        return "none"
    return ("≥ " if result["goodput_is_lower_bound"] else "") + f"{result['goodput']:g} req/s"


def run_rows(workload: dict) -> list[list[str]]:
    rows = []
    for name, result in workload["results"].items():
        for run in result["runs"]:
            ttft, tpot = run["ttft_ms"], run["tpot_ms"]
            rows.append(
                [
                    name,
                    f"{run['rate']:g}",
                    str(run["requests"]),
                    str(run["cut_off"]),
                    f"{_number(ttft['median'], 0)} / {_number(ttft['p99'], 0)}",
                    f"{_number(tpot['median'])} / {_number(tpot['p99'])}",
                    _number(run["request_throughput"], 2),
                    _number(run["output_throughput"], 0),
                    f"{run['slo_attainment']:.0%}",
                    _number(run["within_slo_per_s"], 2),
                    "yes" if run["meets"] else "no",
                ]
            )
    return rows


def tpot_rows(report: dict, workload: dict) -> tuple[list[str], list[list[str]]]:
    """Goodput (req/s) by TPOT SLO, a row per deployment."""
    keys = [f"{tpot:g}" for tpot in report["tpot_slos_ms"]]
    header = ["TPOT SLO (ms)", *keys]
    rows = []
    for name, result in workload["results"].items():
        table = result["goodput_by_tpot_slo"]
        rows.append([name, *("-" if table[key] is None else f"{table[key]:g}" for key in keys)])
    return header, rows


def slo_line(workload: dict) -> str:
    parts = [
        f"{k['name']} (input {k['input_len']}, output {k['output_len']} tokens): "
        f"TTFT <= {k['ttft_slo_ms']:g} ms, TPOT <= {k['tpot_slo_ms']:g} ms"
        for k in workload["classes"]
    ]
    return "; ".join(parts)


def comparison_lines(workload: dict) -> list[str]:
    comparison = workload.get("comparison")
    if comparison is None:
        return []
    lines = []
    for name, other in (("colocated", "disaggregated"), ("disaggregated", "colocated")):
        at = comparison[f"at_strictest_tpot_slo_{name}_meets"]
        if at["tpot_slo_ms"] is None:
            lines.append(f"the {name} deployment meets no TPOT SLO swept at any rate")
            continue
        lines.append(
            f"at the strictest TPOT SLO the {name} deployment meets ({at['tpot_slo_ms']:g} ms): "
            f"{name} {_number(at[name])} req/s, {other} {_number(at[other])} req/s"
        )
    return lines


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
        for row in [header, *rows]
    )


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def print_report(report: dict) -> None:
    for name, deployment in report["deployments"].items():
        print(f"{name}: {deployment['description']}")
        for note in deployment["notes"]:
            print(f"  NOTE: {note}")
    for name, workload in report["workloads"].items():
        print(f"\n=== {name}: {slo_line(workload)} ===")
        print(text_table(list(COLUMNS), run_rows(workload)))
        for deployment, result in workload["results"].items():
            print(f"goodput, {deployment}: {_goodput(result)}")
        print("goodput (req/s) by TPOT SLO:")
        print(text_table(*tpot_rows(report, workload)))
        for line in comparison_lines(workload):
            print(line)


def markdown(report: dict) -> str:
    lines = [f"Model: {report['model']}. Command: `{report['command']}`", ""]
    for name, deployment in report["deployments"].items():
        notes = "".join(f" NOTE: {note}." for note in deployment["notes"])
        lines.append(f"- {name}: {deployment['description']}.{notes}")
    lines += ["", "Definitions:", ""]
    lines += [f"- {key}: {text}" for key, text in report["definitions"].items()]
    for name, workload in report["workloads"].items():
        lines += ["", f"### {name}", "", f"SLOs: {slo_line(workload)}.", ""]
        lines += [markdown_table(list(COLUMNS), run_rows(workload)), ""]
        for deployment, result in workload["results"].items():
            lines.append(f"- goodput, {deployment}: **{_goodput(result)}**")
        lines += ["", "Goodput (req/s) by TPOT SLO:", ""]
        lines += [markdown_table(*tpot_rows(report, workload)), ""]
        lines += [f"- {line}" for line in comparison_lines(workload)]
    return "\n".join(lines) + "\n"


def figure(report: dict, name: str, workload: dict) -> Figure:
    """P99 TPOT and requests within SLO per second against the rate, and goodput against
    the TPOT SLO, both deployments on each panel."""
    fig = Figure(figsize=(16, 4.8), layout="constrained")
    tpot_axes, goodput_axes, slo_axes = fig.subplots(1, 3)
    keys = [f"{tpot:g}" for tpot in report["tpot_slos_ms"]]
    for deployment, result in workload["results"].items():
        color, style = STYLE.get(deployment, (None, "o-"))
        rates = [run["rate"] for run in result["runs"]]
        p99 = [_nan(run["tpot_ms"]["p99"]) for run in result["runs"]]
        tpot_axes.plot(rates, p99, style, color=color, label=deployment)
        within = [run["within_slo_per_s"] for run in result["runs"]]
        goodput_axes.plot(rates, within, style, color=color, label=deployment)
        table = result["goodput_by_tpot_slo"]
        goodputs = [table[key] or 0.0 for key in keys]
        # NOTE: between two swept TPOT SLOs the goodput is at least the stricter one's.
        slo_axes.step(
            report["tpot_slos_ms"], goodputs, style, color=color, label=deployment, where="post"
        )
    for tpot in sorted({k["tpot_slo_ms"] for k in workload["classes"]}):
        tpot_axes.axhline(tpot, color="gray", linestyle=":", label=f"TPOT SLO {tpot:g} ms")
    rates = workload["rates"]
    goodput_axes.plot(rates, rates, ":", color="gray", label="offered rate")
    tpot_axes.set(title="P99 TPOT (completed requests)", ylabel="ms")
    goodput_axes.set(title="Requests within SLO per second", ylabel="req/s")
    for axes in (tpot_axes, goodput_axes):
        axes.set_xscale("log", base=2)
        axes.set_xticks(rates, [f"{rate:g}" for rate in rates])
        axes.set_xlabel("request rate (req/s, Poisson)")
    slo_axes.set(
        title="Goodput: highest rate meeting the SLOs",
        xlabel="TPOT SLO (ms; TTFT SLO unchanged)",
        ylabel="req/s (0: no rate meets)",
    )
    for axes in (tpot_axes, goodput_axes, slo_axes):
        axes.grid(alpha=0.3)
        if axes.has_data():
            axes.legend(fontsize="small")
    fig.suptitle(f"{report['model']}, {name}: {slo_line(workload)}", fontsize="medium")
    return fig


def write_outputs(report: dict, directory: Path) -> list[Path]:
    """results.md and a goodput_WORKLOAD.png per workload; the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / "results.md"]
    written[0].write_text(markdown(report))
    for name, workload in report["workloads"].items():
        if not any(result["runs"] for result in workload["results"].values()):
            continue
        path = directory / f"goodput_{name}.png"
        fig = figure(report, name, workload)
        FigureCanvasAgg(fig)
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="result.json of pd_goodput.py")
    parser.add_argument("--output-dir", type=Path, help="default: the result's directory")
    args = parser.parse_args()
    report = json.loads(args.result.read_text())
    finish_report(report)
    print_report(report)
    for path in write_outputs(report, args.output_dir or args.result.parent):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
