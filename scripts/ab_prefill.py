"""A/B of source trees of cupyflash on the same GPU: each round times every shape in one
process per tree (the tree order rotating), so clock and thermal drift fall on all alike.

    python scripts/ab_prefill.py TREE_A TREE_B [TREE ...] [--rounds 3] [--shapes bf16-64-1024-0 ...]

A shape is dtype-d-N-causal (B = 16384 / N, H = 2048 / d, as the prefill benchmark). Each
process imports the tree's cupyflash (its path is printed) and times it with this checkout's
harness (cupyflash/bench.py), so trees from before a change of timing method compare alike.
Prints each round's cupyflash and cuDNN TFLOP/s per tree, then the medians. Make trees with
`git archive COMMIT cupyflash kernels_cu | tar x -C .ab/COMMIT` (.ab/ is git-ignored locally;
carry it to the GPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
MEASURE = """
import importlib.util, json, os, sys
import cupyflash
assert os.path.realpath(cupyflash.__file__).startswith(os.path.realpath(os.getcwd())), cupyflash.__file__
print("AB-TREE", cupyflash.__file__)
# The timing harness is this checkout's, for every tree (the trees' own bench.py may time
# differently); its `import cupyflash` inside each function finds the tree's package.
spec = importlib.util.spec_from_file_location("ab_bench", {harness!r})
bench = sys.modules["ab_bench"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
rows = []
for case in sys.argv[1:]:
    dtype, d, n, causal = case.split("-")
    shape = bench.PrefillShape(16384 // int(n), int(n), 2048 // int(d), int(d), causal == "1", {dtypes}[dtype])
    rows.append(bench.run_prefill(shape, ("cupyflash", "cudnn")))
print("AB-JSON", json.dumps(rows))
"""


def measure(tree: str, shapes: list[str]) -> list[dict]:
    """One process, run in ``tree``: `python -c` puts the working directory ahead of PYTHONPATH
    on sys.path, so a process run elsewhere would import that directory's cupyflash instead."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(tree), os.environ.get("PYTHONPATH", "")]))
    harness = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cupyflash", "bench.py")
    code = MEASURE.format(dtypes=DTYPES, harness=os.path.abspath(harness))
    out = subprocess.run(
        [sys.executable, "-c", code, *shapes], cwd=tree, env=env, capture_output=True, text=True, check=True
    )
    print(next(text for text in out.stdout.splitlines() if text.startswith("AB-TREE ")), flush=True)
    line = next(text for text in out.stdout.splitlines() if text.startswith("AB-JSON "))
    return json.loads(line[len("AB-JSON ") :])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", nargs="+", default=["bf16-64-1024-0", "bf16-64-1024-1", "fp16-64-1024-1"])
    args = parser.parse_args()
    results: dict[str, list[list[dict]]] = {tree: [] for tree in args.trees}
    for r in range(args.rounds):
        for tree in args.trees[r % len(args.trees) :] + args.trees[: r % len(args.trees)]:
            rows = measure(tree, args.shapes)
            results[tree].append(rows)
            print(
                f"round {r} {tree:24}",
                " ".join(f"{s}: {x['cupyflash']}/{x['cudnn']}" for s, x in zip(args.shapes, rows)),
                flush=True,
            )
    print("medians (cupyflash / cuDNN TFLOP/s):")
    for tree, rounds in results.items():
        cells = []
        for i, shape in enumerate(args.shapes):
            ours = statistics.median(rows[i]["cupyflash"] for rows in rounds)
            cudnn = statistics.median(rows[i]["cudnn"] for rows in rounds)
            cells.append(f"{shape}: {ours:.1f}/{cudnn:.1f}")
        print(f"  {tree:24}", " ".join(cells))


if __name__ == "__main__":
    main()
