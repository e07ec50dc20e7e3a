"""How benchmarks/attention.py reads: one progress line per case, and the markdown tables
printed last (the figures themselves are in its JSON)."""

from __future__ import annotations

# Above this the kernel's output is flagged as wrong (bf16 rounding gives ~4e-3).
MAX_REL_ERROR = 2e-2


def error_note(error: float | None) -> str:
    if error is None:
        return "-"
    flag = "" if error <= MAX_REL_ERROR else " FAIL"
    return f"{error:.1e}{flag}"


def decode_line(case: dict) -> str:
    if "skipped" in case:
        return f"decode {case['shape']} B={case['batch']} ctx={case['context']}: {case['skipped']}"
    parts = [f"decode {case['shape']} B={case['batch']} ctx={case['context']}:"]
    for result in case["configs"]:
        timing = f"{result['us']:.1f} us" if "us" in result else result["error"]
        parts.append(
            f"{result['config']} (splits {result['splits']}) {timing} "
            f"err {error_note(result.get('rel_error'))}"
        )
    ref = f"{case['ref_us']:.1f} us" if "ref_us" in case else case.get("ref_skipped")
    return " | ".join([*parts, f"ref {ref}"])


def extend_line(case: dict) -> str:
    parts = [f"extend {case['shape']} T={case['tokens']}:"]
    for result in case["configs"]:
        timing = f"{result['us']:.1f} us" if "us" in result else result["error"]
        parts.append(f"{result['config']} {timing} err {error_note(result.get('rel_error'))}")
    return " | ".join([*parts, f"ref {case['ref_us']:.1f} us"])


def decode_table(cases: list[dict], ceilings: dict) -> str:
    measured = [c for c in cases if "configs" in c]
    variants = [r["config"] for r in measured[0]["configs"][1:]]
    head = ["shape", "B", "ctx", "KV MiB", "splits", "µs", "GB/s", "% copy", "ref µs", "×"]
    head += ["rel err", *(f"{v} µs" for v in variants)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in measured:
        first, others = case["configs"][0], case["configs"][1:]
        ref_us = case.get("ref_us")
        errors = [r["rel_error"] for r in case["configs"] if "rel_error" in r]
        row = [
            case["shape"],
            str(case["batch"]),
            str(case["context"]),
            f"{case['kv_bytes'] / (1 << 20):,.0f}",
            str(first["splits"]),
            _us(first),
            f"{first['gb_per_s']:,.0f}" if "us" in first else "-",
            f"{first['pct_copy']:.0f}" if "us" in first else "-",
            f"{ref_us:,.1f}" if ref_us else "-",
            f"{ref_us / first['us']:.1f}" if ref_us and "us" in first else "-",
            error_note(max(errors) if errors else None) + _checked_note(case),
            *(_us(r) for r in others),
        ]
        lines.append("| " + " | ".join(row) + " |")
    copy = ceilings["copy_gb_per_s"]
    lines.append(
        f"\nDecode: first config `{measured[0]['configs'][0]['config']}`; GB/s counts K+V, q, "
        f"out and page table; % copy is against the copy ceiling {copy:,.0f} GB/s "
        "(read + written), as is. rel err: the worst config, vs the torch reference."
    )
    return "\n".join(lines)


def extend_table(cases: list[dict], ceilings: dict) -> str:
    head = ["shape", "T", "config", "blocks", "µs", "TFLOP/s", "% GEMM", "× ref", "rel err"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in cases:
        for r in case["configs"]:
            blocks = "x".join(map(str, r["blocks"])) if r.get("blocks") else "-"
            row = [case["shape"], str(case["tokens"]), r["config"], blocks, _us(r)]
            if "us" in r:
                row += [f"{r['tflop_per_s']:.0f}", f"{r['pct_gemm']:.0f}", f"{r['speedup']:.1f}"]
            else:
                row += ["-", "-", "-"]
            lines.append("| " + " | ".join([*row, error_note(r.get("rel_error"))]) + " |")
        ref = [case["shape"], str(case["tokens"]), "torch ref", "-", f"{case['ref_us']:,.1f}"]
        ref += [f"{case['ref_tflop_per_s']:.0f}", "-", "1.0", "-"]
        lines.append("| " + " | ".join(ref) + " |")
    lines.append(
        f"\nExtend: causal FLOPs (4·heads·head_dim·T²/2); % GEMM is against the bf16 "
        f"{ceilings['gemm_size']}³ GEMM ceiling {ceilings['gemm_tflop_per_s']:,.0f} TFLOP/s."
    )
    return "\n".join(lines)


def _checked_note(case: dict) -> str:
    checked, batch = case["checked_seqs"], case["batch"]
    return "" if checked in (0, batch) else f" ({checked}/{batch} seqs)"


def _us(result: dict) -> str:
    if "us" in result:
        return f"{result['us']:,.1f}"
    return "OOR" if "OutOfResources" in result.get("error", "") else "error"
