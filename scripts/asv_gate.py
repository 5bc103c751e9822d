"""Regression gate over the committed asv results: the newest measured commit on the current
branch against the measured commit before it, on the H200 machine (``--pairs N``: each of the
newest N measured commits against the one before it, for a run over a commit range).

A benchmark regresses when it moves the wrong way (TFLOP/s, GB/s or a ratio down; us, s or %
up) by more than its noise threshold. What is gated:
* the ratio benchmarks (unit "ratio": ``prefill.PrefillOverGemm`` and the like): cupyflash's
  throughput over a fixed reference measured in the same setup_cache on the same GPU -- a
  cuBLAS bf16 GEMM, or for decode a device-to-device copy (benchmarks_asv/benchmarks/
  _reference.py). Every session may get a different H200 host, and between two of them the
  same code moved by up to 25% (cuDNN at N = 1024, asv runs of 261e2f6 and 1661eae), which an
  absolute gate reads as a regression of code that did not change; the reference is the same
  code at every commit, so it moves with the host only;
* in a family with such a ratio, nothing else: the absolute values, the reference's own entry
  and the peers (cuDNN, PyTorch flash, FlashAttention-4), with cupyflash's ratios to them
  (``prefill.PrefillOverPeers`` and the like), are listed as context, not gated;
* the host time (CPU work, which the GPU references do not track): cupyflash's calls over
  SDPA's tiny call measured in the same process;
* the rest (compile time): absolute values.
A peer's entry is never gated. A benchmark whose asv version (the hash of its code) changed
between the two commits starts a new series and is not compared; one no longer in the suite
(benchmarks.json) is skipped.

Thresholds come from measurement, per benchmark: a commit run twice (once under the machine
name h200-repeat, see scripts/asv_gpu.sh) with the same benchmark version gives the spread of
identical code over the benchmark's parameters; the gate allows max(MIN_THRESHOLD, 2 x the
largest spread). Measured on the H200: prefill TFLOP/s moved up to ~10% at N = 1024 (short
kernels) and ~1% at N = 16384, host times ~10-30%, first-call compile times several-fold
(NVRTC's precompiled-header cache), so one shared threshold would either cry wolf or miss real
drops. Exits 1 on a regression.
Reads asv's JSON directly (no asv import), so it runs wherever the results are checked out.

    python scripts/asv_gate.py [--results benchmarks_asv/results] [--machine h200] [--pairs N]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

MIN_THRESHOLD = 0.03
#: A benchmark's throughput over the fixed reference of its run (benchmarks_asv/benchmarks/_reference.py).
RATIO = "ratio"
HIGHER_IS_BETTER = {"TFLOP/s", "GB/s", RATIO}


Results = dict[str, dict[str, tuple[list[tuple[str, ...]], list[float | None], str | None]]]

#: Families without a fixed reference -> the entry (first parameter) measured beside cupyflash's
#: in the same process, that cupyflash's are read against.
IN_RUN_REFERENCES = {"host.": "'sdpa_us'"}
#: Entries that measure other libraries (first parameter: the peer's name; the peer-ratio
#: benchmarks' too): shown beside cupyflash's, never gated.
PEERS = {"'flash'", "'cudnn'", "'fa4'", "'sdpa_us'"}

Values = dict[tuple[str, ...], float | None]


def is_context(name: str, benchmarks: dict[str, Any]) -> bool:
    """A benchmark listed but not gated: in a family (module) that has a ratio benchmark, every
    benchmark but the ratios (the absolute values, the fixed reference's own entry)."""
    family = name.split(".", 1)[0] + "."
    units = [b.get("unit") for n, b in benchmarks.items() if isinstance(b, dict) and n.startswith(family)]
    return RATIO in units and benchmarks[name].get("unit") != RATIO


def reference_of(name: str, *entries: Values) -> str | None:
    """The in-run reference entry of a benchmark, if every one of ``entries`` measured it."""
    ref = next((ref for prefix, ref in IN_RUN_REFERENCES.items() if name.startswith(prefix)), None)
    return ref if ref is not None and all(any(c and c[0] == ref for c in e) for e in entries) else None


def gated_value(values: Values, combo: tuple[str, ...], ref: str | None) -> float | None:
    """The value the gate compares: over the in-run reference's value at the same other
    parameters where there is one, else the value itself; None where either is missing."""
    value = values.get(combo)
    if ref is None or not value:
        return value
    base = values.get((ref, *combo[1:]))
    return value / base if base else None


def load_results(machine_dir: Path) -> Results:
    """commit hash -> benchmark name -> (parameter combinations, values in that order, asv
    version of the benchmark's code)."""
    by_commit: Results = {}
    for path in sorted(machine_dir.glob("*.json")):
        if path.name == "machine.json":
            continue
        data = json.loads(path.read_text())
        column = data["result_columns"].index("result")
        params_column = data["result_columns"].index("params")
        version_column = data["result_columns"].index("version") if "version" in data["result_columns"] else None
        values = {}
        for name, row in data["results"].items():
            result = row[column] if isinstance(row, list) else row
            params = row[params_column] if isinstance(row, list) else []
            if result is not None:
                combos = list(itertools.product(*params)) if params else [()]
                clean = [None if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in result]
                version = row[version_column] if isinstance(row, list) and version_column is not None else None
                values[name] = (combos, clean, version)
        by_commit[data["commit_hash"]] = values
    return by_commit


def worse_by(unit: str, old: float, new: float) -> float:
    """How much worse new is than old, as a fraction (negative: better)."""
    if unit in HIGHER_IS_BETTER:
        return (old - new) / old
    return (new - old) / old


def values_of(results: Results, commit: str, name: str) -> Values:
    combos, values, _ = results[commit][name]
    return dict(zip(combos, values))


def noise_thresholds(results_dir: Path, machine: str) -> tuple[dict[str, float], str]:
    """Benchmark name -> allowed relative slowdown, and where it came from. One threshold per
    benchmark over all its parameters: with a single repeat per parameter the spread is a thin
    sample (the tiny-call host time moved 2% between the two runs of one commit and 11% between
    two commits of identical code), so each parameter borrows the worst spread of its family.
    Spreads are of the gated values (the ratios; the host time over its in-run reference), from
    the commits run twice with the same benchmark version, relative to the smaller of the two
    values: a spread must not depend on which run came first (585b5e0's compile benchmark
    measured 1.19 s on a fresh machine, then 0.18 s: a 6.7x spread, where relative to the first
    run it read as 0.85x and allowed the same pair in the other order to fail the gate)."""
    repeat_dir = results_dir / f"{machine}-repeat"
    if not repeat_dir.is_dir():
        return {}, f"no repeated run committed: {MIN_THRESHOLD:.0%} for all"
    first, again = load_results(results_dir / machine), load_results(repeat_dir)
    thresholds: dict[str, float] = {}
    for commit in set(first) & set(again):
        for name in set(first[commit]) & set(again[commit]):
            if first[commit][name][2] != again[commit][name][2]:
                continue
            a_values, b_values = values_of(first, commit, name), values_of(again, commit, name)
            ref = reference_of(name, a_values, b_values)
            for combo in a_values:
                a, b = gated_value(a_values, combo, ref), gated_value(b_values, combo, ref)
                if a and b and not (combo and combo[0] in PEERS):
                    thresholds[name] = max(thresholds.get(name, MIN_THRESHOLD), 2 * abs(b - a) / min(a, b))
    return thresholds, (f"2 x the largest spread of a commit run twice, per benchmark, at least {MIN_THRESHOLD:.0%} "
                        f"({MIN_THRESHOLD:.0%} where no repeat of the benchmark's version is committed)")  # fmt: skip


def branch_order() -> list[str]:
    out = subprocess.run(["git", "rev-list", "--first-parent", "HEAD"], capture_output=True, text=True, check=True)
    return out.stdout.split()


def compare(
    benchmarks: dict[str, Any], by_commit: Results, new: str, old: str, thresholds: dict[str, float]
) -> list[str]:
    """Print ``new`` against ``old`` entry by entry; returns the entries that regressed."""
    regressions = []
    for name in sorted(set(by_commit[new]) & set(by_commit[old])):
        if name not in benchmarks:
            continue
        unit = benchmarks[name].get("unit", "")
        if by_commit[new][name][2] != by_commit[old][name][2]:
            print(f"  {name}: its code changed between the two commits (asv version): a new series, not compared")
            continue
        old_values, new_values = values_of(by_commit, old, name), values_of(by_commit, new, name)
        context = is_context(name, benchmarks)
        ref = reference_of(name, old_values, new_values)
        for combo, y in new_values.items():
            x = old_values.get(combo)
            label = ", ".join(combo)
            if context or (combo and combo[0] in PEERS):
                if x and y:
                    why = "a peer" if combo and combo[0] in PEERS else "context"
                    moved = -worse_by(unit, x, y)
                    print(f"  {name}({label}): {x:.4g} -> {y:.4g} {unit} ({moved:+.1%}; {why}, not gated)")
                continue
            a, b = gated_value(old_values, combo, ref), gated_value(new_values, combo, ref)
            basis = f"x {ref}" if ref else unit
            if x and y and not (a and b):  # the in-run reference is missing at this point: compare absolutes
                a, b, basis = x, y, f"{unit} (no reference value here)"
            if not a or not b:
                continue
            threshold = thresholds.get(name, MIN_THRESHOLD)
            allowed = f"allowed {threshold:.0%}" + ("" if name in thresholds else ", no repeat")
            change = worse_by(unit, a, b)
            flag = "REGRESSION" if change > threshold else ""
            print(f"  {name}({label}): {a:.4g} -> {b:.4g} {basis} ({-change:+.1%}, {allowed}) {flag}")
            if flag:
                regressions.append(f"{new[:10]}: {name}({label})")
    return regressions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("benchmarks_asv/results"))
    parser.add_argument("--machine", default="h200")
    parser.add_argument(
        "--pairs", type=int, default=1,
        help="compare each of the newest N measured commits with the measured one before it (a run over "
        "a commit range: N = the commits it measured); default 1",
    )  # fmt: skip
    args = parser.parse_args()
    benchmarks = json.loads((args.results / "benchmarks.json").read_text())
    by_commit = load_results(args.results / args.machine)
    measured = [c for c in branch_order() if c in by_commit]
    if len(measured) < 2:
        print(f"asv gate: {len(measured)} measured commit(s) on this branch; nothing to compare")
        return 0
    thresholds, why = noise_thresholds(args.results, args.machine)
    regressions = []
    for new, old in list(zip(measured, measured[1:]))[: max(args.pairs, 1)]:
        print(f"asv gate: {new[:10]} vs {old[:10]} on {args.machine}; thresholds: {why}")
        regressions += compare(benchmarks, by_commit, new, old, thresholds)
    if regressions:
        print(f"asv gate: {len(regressions)} regression(s) beyond their thresholds: {regressions}")
        return 1
    print("asv gate: no regression")
    return 0


if __name__ == "__main__":
    sys.exit(main())
