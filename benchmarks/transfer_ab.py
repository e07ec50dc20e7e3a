"""A/B of benchmarks/transfer.py between two trees: runs each tree's own transfer.py
alternately (old, new, old, new, ...) so a busy host's drift hits both, and prints the
medians over the runs, old vs new, with new/old.

    python benchmarks/transfer_ab.py --old-tree /work/wt/bench-old --new-tree . --pairs 3 \
        --backend tcp --sizes-mib 16 64 --repeats 5
    python benchmarks/transfer_ab.py --old-tree ../old --new-tree . --backend gloo --protocol-only

Arguments other than the driver's own go to transfer.py. Each run imports pdserve from its
tree (PYTHONPATH and cwd set to it; checked before the runs). Reported: effective (paged)
GiB/s and raw GiB/s per size, or with --protocol-only each step of `median_steps_ms`.
No torch here: subprocess and json only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def tree_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def check_import(tree: Path) -> None:
    """pdserve may be installed editable from another tree: make sure this one is imported."""
    probe = [sys.executable, "-c", "import pdserve; print(pdserve.__file__)"]
    path = subprocess.run(probe, cwd=tree, env=tree_env(tree), capture_output=True, text=True)
    imported = Path(path.stdout.strip()).resolve()
    if not imported.is_relative_to(tree):
        sys.exit(f"{tree}: imports pdserve from {imported}")


def run_once(tree: Path, rest: list[str], output: Path, timeout_s: float) -> dict | None:
    """One run of the tree's transfer.py; its JSON report, or None if it failed."""
    command = [sys.executable, "benchmarks/transfer.py", *rest, "--output", str(output)]
    try:
        done = subprocess.run(
            command,
            cwd=tree,
            env=tree_env(tree),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        print(f"  {tree.name}: timed out after {timeout_s:.0f} s", file=sys.stderr)
        return None
    if done.returncode != 0:
        tail = "\n    ".join(done.stderr.strip().splitlines()[-6:])
        print(f"  {tree.name}: failed (rc {done.returncode}):\n    {tail}", file=sys.stderr)
        return None
    return json.loads(output.read_text())


def metrics(report: dict) -> dict[str, float]:
    """The figures compared, by row name."""
    if "median_steps_ms" in report:
        return {f"{step} ms": t for step, t in report["median_steps_ms"].items()}
    rows = {}
    for result in report["results"]:
        rows[f"{result['size_mib']} MiB paged GiB/s"] = result["paged_gib_s"]
        rows[f"{result['size_mib']} MiB raw GiB/s"] = result["raw_gib_s"]
    return rows


def table(runs: dict[str, list[dict]]) -> str:
    """Medians over each side's runs; rows in the new tree's order, then the old's extra."""
    values = {side: {} for side in runs}
    for side, reports in runs.items():
        for report in reports:
            for name, value in metrics(report).items():
                values[side].setdefault(name, []).append(value)
    names = list(dict.fromkeys([*values["new"], *values["old"]]))
    width = max(map(len, names), default=10)
    lines = [f"{'':{width}}  {'old':>10}  {'new':>10}  {'new/old':>8}  runs"]
    for name in names:
        old, new = (values[side].get(name) for side in ("old", "new"))
        medians = [statistics.median(v) if v else None for v in (old, new)]
        cells = [f"{m:10.3f}" if m is not None else f"{'-':>10}" for m in medians]
        ratio = f"{medians[1] / medians[0]:8.3f}" if None not in medians and medians[0] else "-"
        counts = f"{len(old or [])}/{len(new or [])}"
        lines.append(f"{name:{width}}  {cells[0]}  {cells[1]}  {ratio:>8}  {counts}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-tree", type=Path, required=True)
    parser.add_argument("--new-tree", type=Path, required=True)
    parser.add_argument("--pairs", type=int, default=3, help="old/new runs, alternated")
    parser.add_argument("--run-timeout-s", type=float, default=900, help="per transfer.py run")
    parser.add_argument("--save", type=Path, help="write every run's report here (JSON)")
    args, rest = parser.parse_known_args()
    if "--output" in rest:
        parser.error("--output is the driver's: use --save")
    trees = {"old": args.old_tree.resolve(), "new": args.new_tree.resolve()}
    for tree in trees.values():
        check_import(tree)
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    failures = {"old": 0, "new": 0}
    with tempfile.TemporaryDirectory() as scratch:
        for pair in range(args.pairs):
            for side, tree in trees.items():
                print(f"pair {pair + 1}/{args.pairs}: {side}", file=sys.stderr, flush=True)
                output = Path(scratch, f"{side}-{pair}.json")
                report = run_once(tree, rest, output, args.run_timeout_s)
                if report is None:
                    failures[side] += 1
                else:
                    runs[side].append(report)
    print(f"transfer.py {' '.join(rest)}")
    print(f"old: {trees['old']}\nnew: {trees['new']}")
    print(f"pairs: {args.pairs}; failed runs: old {failures['old']}, new {failures['new']}")
    print(table(runs))
    if args.save:
        saved = {"args": rest, "trees": {side: str(tree) for side, tree in trees.items()}}
        saved |= {"failures": failures, "runs": runs}
        args.save.write_text(json.dumps(saved, indent=2))
    if any(failures.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
