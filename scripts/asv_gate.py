"""Regression gate over the committed asv results: the newest measured commit on the current
branch against the measured commit before it, on the H200 machine.

A benchmark regresses when it moves the wrong way (TFLOP/s or GB/s down; us, s or % up) by more
than its noise threshold. Thresholds come from measurement, per benchmark: a commit run twice
(once under the machine name h200-repeat, see scripts/asv_gpu.sh) gives the spread of identical
code over the benchmark's parameters; the gate allows max(MIN_THRESHOLD, 2 x the largest
spread). Measured on the H200: prefill TFLOP/s moved up to ~10% at N = 1024 (short kernels)
and ~1% at N = 16384, host times ~10-30%, first-call compile times several-fold (NVRTC's
precompiled-header cache), so one shared threshold would either cry wolf or miss real drops.
Exits 1 on a regression.
Reads asv's JSON directly (no asv import), so it runs wherever the results are checked out.

    python scripts/asv_gate.py [--results benchmarks_asv/results] [--machine h200]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

MIN_THRESHOLD = 0.03
HIGHER_IS_BETTER = {"TFLOP/s", "GB/s"}


def load_results(machine_dir: Path) -> dict[str, dict[str, list[float | None]]]:
    """commit hash -> benchmark name -> flat list of values (params product order)."""
    by_commit: dict[str, dict[str, list[float | None]]] = {}
    for path in sorted(machine_dir.glob("*.json")):
        if path.name == "machine.json":
            continue
        data = json.loads(path.read_text())
        column = data["result_columns"].index("result")
        values = {}
        for name, row in data["results"].items():
            result = row[column] if isinstance(row, list) else row
            if result is not None:
                values[name] = [None if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in result]
        by_commit[data["commit_hash"]] = values
    return by_commit


def labels(benchmark: dict) -> list[str]:
    params = benchmark.get("params") or []
    if not params:
        return [""]
    return [", ".join(combo) for combo in itertools.product(*params)]


def worse_by(unit: str, old: float, new: float) -> float:
    """How much worse new is than old, as a fraction (negative: better)."""
    if unit in HIGHER_IS_BETTER:
        return (old - new) / old
    return (new - old) / old


def noise_thresholds(results_dir: Path, machine: str) -> tuple[dict[str, float], str]:
    """Benchmark name -> allowed relative slowdown, and where it came from. One threshold per
    benchmark over all its parameters: with a single repeat per parameter the spread is a thin
    sample (the tiny-call host time moved 2% between the two runs of one commit and 11% between
    two commits of identical code), so each parameter borrows the worst spread of its family."""
    repeat_dir = results_dir / f"{machine}-repeat"
    if not repeat_dir.is_dir():
        return {}, f"no repeated run committed: {MIN_THRESHOLD:.0%} for all"
    first, again = load_results(results_dir / machine), load_results(repeat_dir)
    thresholds: dict[str, float] = {}
    for commit in set(first) & set(again):
        for name in set(first[commit]) & set(again[commit]):
            for a, b in zip(first[commit][name], again[commit][name]):
                if a and b:
                    thresholds[name] = max(thresholds.get(name, MIN_THRESHOLD), 2 * abs(b - a) / a)
    return thresholds, f"2 x the largest spread of a commit run twice, per benchmark, at least {MIN_THRESHOLD:.0%}"


def branch_order() -> list[str]:
    out = subprocess.run(["git", "rev-list", "--first-parent", "HEAD"], capture_output=True, text=True, check=True)
    return out.stdout.split()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("benchmarks_asv/results"))
    parser.add_argument("--machine", default="h200")
    args = parser.parse_args()
    benchmarks = json.loads((args.results / "benchmarks.json").read_text())
    by_commit = load_results(args.results / args.machine)
    measured = [c for c in branch_order() if c in by_commit]
    if len(measured) < 2:
        print(f"asv gate: {len(measured)} measured commit(s) on this branch; nothing to compare")
        return 0
    new, old = measured[0], measured[1]
    thresholds, why = noise_thresholds(args.results, args.machine)
    print(f"asv gate: {new[:10]} vs {old[:10]} on {args.machine}; thresholds: {why}")
    regressions = []
    for name in sorted(set(by_commit[new]) & set(by_commit[old])):
        unit = benchmarks.get(name, {}).get("unit", "")
        pairs = zip(labels(benchmarks.get(name, {})), by_commit[old][name], by_commit[new][name])
        for label, a, b in pairs:
            if not a or not b:
                continue
            threshold = thresholds.get(name, MIN_THRESHOLD)
            change = worse_by(unit, a, b)
            flag = "REGRESSION" if change > threshold else ""
            print(f"  {name}({label}): {a:.4g} -> {b:.4g} {unit} ({-change:+.1%}, allowed {threshold:.0%}) {flag}")
            if flag:
                regressions.append(f"{name}({label})")
    if regressions:
        print(f"asv gate: {len(regressions)} regression(s) beyond their thresholds: {regressions}")
        return 1
    print("asv gate: no regression")
    return 0


if __name__ == "__main__":
    sys.exit(main())
