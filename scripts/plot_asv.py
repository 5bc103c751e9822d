"""The README chart: prefill TFLOP/s of cupyflash (default dispatch and its FA2 kernel), PyTorch
SDPA flash and cuDNN per shape, from the newest committed asv results of the H200 machine (the
12-shape prefill benchmark where a commit has it, else the first suite's 8 shapes).

    python scripts/plot_asv.py [--results benchmarks_asv/results] [--out docs/asv_prefill.png]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from asv_gate import load_results  # noqa: E402

BENCHMARKS = ("prefill.Prefill.track_tflops", "fa2_prefill.Fa2Prefill.track_tflops")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", type=Path, default=Path("benchmarks_asv/results"))
    parser.add_argument("--machine", default="h200")
    parser.add_argument("--out", type=Path, default=Path("docs/asv_prefill.png"))
    args = parser.parse_args()
    benchmarks = json.loads((args.results / "benchmarks.json").read_text())
    by_commit = load_results(args.results / args.machine)
    order = subprocess.run(["git", "rev-list", "HEAD"], capture_output=True, text=True, check=True).stdout.split()
    commit, benchmark = next((c, b) for c in order for b in BENCHMARKS if c in by_commit and b in by_commit[c])
    params = benchmarks[benchmark]["params"]
    values = dict(zip(itertools.product(*params), by_commit[commit][benchmark]))
    backends, shapes = params[0], list(itertools.product(*params[1:]))
    fig, ax = plt.subplots(figsize=(12, 4))
    width = 0.8 / len(backends)
    for i, backend in enumerate(backends):
        heights = [values.get((backend, *shape)) or 0.0 for shape in shapes]
        ax.bar([x + i * width for x in range(len(shapes))], heights, width, label=backend.strip("'"))
    ax.set_xticks([x + width * (len(backends) - 1) / 2 for x in range(len(shapes))])
    ax.set_xticklabels([f"d={d}\nN={n}\n{'causal' if c == 'True' else 'full'}" for d, n, c in shapes], fontsize=8)
    ax.set_ylabel("TFLOP/s (bf16)")
    ax.set_title(f"Attention forward on the H200, asv results of {commit[:10]}: cupyflash vs PyTorch SDPA backends")
    ax.legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
