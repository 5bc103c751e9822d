"""A/B of source trees of cupyflash on the same GPU. Each round measures every tree in its own
process (the tree order rotating), so clock and thermal drift fall on all alike; the report
gives each round and the medians over rounds.

    python scripts/ab.py prefill TREE_A TREE_B [TREE ...] [--rounds 3] [--shapes bf16-64-1024-0 ...]
    python scripts/ab.py train TREE_A TREE_B [TREE ...] [--rounds 3] [--shapes bf16-128-4096-1 ...]
    python scripts/ab.py host TREE_A TREE_B [TREE ...] [--rounds 5] [--calls 2000]
    python scripts/ab.py decode TREE_A TREE_B [TREE ...] [--rounds 3] [--shapes 1-131072 ...]

prefill: TFLOP/s of cupyflash and cuDNN (PyTorch SDPA) per shape; a shape is dtype-d-N-causal
(B = 16384 / N, H = 2048 / d, as the prefill benchmark). Each process imports the tree's
cupyflash and times it with this checkout's harness (cupyflash/bench.py), so trees from before a
change of timing method compare alike.

train: TFLOP/s of a training step (forward + backward through autograd) and of the backward
alone, cupyflash and cuDNN, per shape as prefill's (bench.run_training).

decode: microseconds per decode step (bf16, GQA 32/8, d = 128, one token, full caches) of
cupyflash's automatic split and of cuDNN, per shape B-L, with this checkout's harness as prefill.

host: host time per tiny call, in microseconds: a prefill of one query block (B = 1, N = 128,
H = 8, d = 128, causal) and a decode step (B = 1, one token, Hq = 8, Hkv = 2, d = 128, a 512-token
cache through attention_with_kvcache), each with torch tensors (bf16) and CuPy arrays (fp16),
beside PyTorch SDPA on the same tensors in the same process (the reference: its host time moves
with the machine too). Each entry is the median per-call time over ``--calls`` calls after a
warm-up; the report gives the medians over rounds and each entry's ratio to SDPA. Only the
public API is timed, so a tree whose private modules differ (an old export) measures alike.

Make trees with ``git archive COMMIT cupyflash kernels_cu | tar x -C .ab/COMMIT`` (.ab/ is
git-ignored locally; carry it to the GPU machine); ``.`` is this checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
PREAMBLE = """
import json, os, sys
import cupyflash
assert os.path.realpath(cupyflash.__file__).startswith(os.path.realpath(os.getcwd())), cupyflash.__file__
print("AB-TREE", cupyflash.__file__, flush=True)
"""
LOAD_HARNESS = """
import importlib.util
# The timing harness is this checkout's, for every tree (the trees' own bench.py may time
# differently); its `import cupyflash` inside each function finds the tree's package.
spec = importlib.util.spec_from_file_location("ab_bench", {harness!r})
bench = sys.modules["ab_bench"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
rows = []
"""
MEASURE_PREFILL = (
    LOAD_HARNESS
    + """
for case in sys.argv[1:]:
    dtype, d, n, causal = case.split("-")
    shape = bench.PrefillShape(16384 // int(n), int(n), 2048 // int(d), int(d), causal == "1", {dtypes}[dtype])
    rows.append(bench.run_prefill(shape, ("cupyflash", "cudnn"), timings=("interleaved",)))
print("AB-JSON", json.dumps(rows))
"""
)
MEASURE_TRAIN = (
    LOAD_HARNESS
    + """
for case in sys.argv[1:]:
    dtype, d, n, causal = case.split("-")
    shape = bench.PrefillShape(16384 // int(n), int(n), 2048 // int(d), int(d), causal == "1", {dtypes}[dtype])
    row = bench.run_training(shape, ("cupyflash", "cudnn"), timings=("interleaved",))
    rows.append({{key: row[key] for key in ("cupyflash", "cudnn", "cupyflash_bwd", "cudnn_bwd")}})
print("AB-JSON", json.dumps(rows))
"""
)
MEASURE_DECODE = (
    LOAD_HARNESS
    + """
for case in sys.argv[1:]:
    b, n = case.split("-")
    row = bench.run_decode(bench.DecodeShape(int(b), int(n)))
    rows.append({{"cupyflash": row.get("cupyflash_steady_us"), "cudnn": row.get("cudnn_steady_us")}})
print("AB-JSON", json.dumps(rows))
"""
)
MEASURE_HOST = """
import statistics, time
import cupy, torch
calls = int(sys.argv[1])
sdpa = torch.nn.functional.scaled_dot_product_attention

def torch_inputs(*shapes):
    return [torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in shapes]

def cupy_inputs(*shapes):
    return [cupy.random.standard_normal(s, dtype=cupy.float32).astype(cupy.float16) for s in shapes]

prefill = ((1, 128, 8, 128), (1, 128, 8, 128), (1, 128, 8, 128))
decode = ((1, 1, 8, 128), (1, 512, 2, 128), (1, 512, 2, 128))
tq, tk, tv = torch_inputs(*prefill)
cq, ck, cv = cupy_inputs(*prefill)
dq, dk, dv = torch_inputs(*decode)
eq, ek, ev = cupy_inputs(*decode)
tlen = torch.full((1,), 500, dtype=torch.int32, device="cuda")
clen = cupy.full((1,), 500, dtype=cupy.int32)
sq, sk, sv = (x.transpose(1, 2) for x in (tq, tk, tv))
sdq, sdk, sdv = (x.transpose(1, 2) for x in (dq, dk, dv))
cases = {
    "prefill_torch": (lambda: cupyflash.attention(tq, tk, tv, causal=True), torch.cuda.synchronize),
    "prefill_cupy": (lambda: cupyflash.attention(cq, ck, cv, causal=True), cupy.cuda.Device().synchronize),
    "prefill_sdpa": (lambda: sdpa(sq, sk, sv, is_causal=True), torch.cuda.synchronize),
    "decode_torch": (lambda: cupyflash.attention_with_kvcache(dq, dk, dv, cache_seqlens=tlen), torch.cuda.synchronize),
    "decode_cupy": (lambda: cupyflash.attention_with_kvcache(eq, ek, ev, cache_seqlens=clen),
                    cupy.cuda.Device().synchronize),
    "decode_sdpa": (lambda: sdpa(sdq, sdk, sdv, enable_gqa=True), torch.cuda.synchronize),
}

def per_call_us(call, sync, n):
    samples = []
    for i in range(n):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
        if i % 100 == 99:
            sync()  # keep the launch queue short: time the host, not a full queue
    sync()
    return statistics.median(samples) * 1e6

for call, sync in cases.values():
    per_call_us(call, sync, 200)  # warm-up: compile, plan caches
print("AB-JSON", json.dumps({name: round(per_call_us(call, sync, calls), 2) for name, (call, sync) in cases.items()}))
"""


def measure(tree: str, code: str, args: list[str]) -> Any:
    """One process, run in ``tree``: `python -c` puts the working directory ahead of PYTHONPATH
    on sys.path, so a process run elsewhere would import that directory's cupyflash instead."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(tree), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-c", PREAMBLE + code, *args], cwd=tree, env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        sys.exit(f"{tree}: the measuring process failed (rc {out.returncode}):\n{out.stderr[-4000:]}")
    print(next(text for text in out.stdout.splitlines() if text.startswith("AB-TREE ")), flush=True)
    line = next(text for text in out.stdout.splitlines() if text.startswith("AB-JSON "))
    return json.loads(line[len("AB-JSON ") :])


def rounds(trees: list[str], count: int, code: str, args: list[str], show: Any) -> dict[str, list[Any]]:
    """``count`` rounds, each tree once per round in a rotating order."""
    results: dict[str, list[Any]] = {tree: [] for tree in trees}
    for r in range(count):
        for tree in trees[r % len(trees) :] + trees[: r % len(trees)]:
            result = measure(tree, code, args)
            results[tree].append(result)
            print(f"round {r} {tree:24}", show(result), flush=True)
    return results


def ab_prefill(args: argparse.Namespace) -> None:
    harness = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cupyflash", "bench.py")
    measure_code = {"prefill": MEASURE_PREFILL, "train": MEASURE_TRAIN, "decode": MEASURE_DECODE}[args.mode]
    code = measure_code.format(dtypes=DTYPES, harness=os.path.abspath(harness))
    show = lambda rows: " ".join(f"{s}: {x['cupyflash']}/{x['cudnn']}" for s, x in zip(args.shapes, rows))  # noqa: E731
    results = rounds(args.trees, args.rounds, code, args.shapes, show)
    unit = {"prefill": "TFLOP/s", "train": "TFLOP/s of the step (of the backward)", "decode": "us per step"}[args.mode]
    print(f"medians (cupyflash / cuDNN {unit}):")
    for tree, per_round in results.items():
        cells = []
        for i, shape in enumerate(args.shapes):
            ours, cudnn = (statistics.median(rows[i][key] for rows in per_round) for key in ("cupyflash", "cudnn"))
            cell = f"{shape}: {ours:.1f}/{cudnn:.1f}"
            if args.mode == "train":
                ours_bwd, cudnn_bwd = (statistics.median(rows[i][f"{key}_bwd"] for rows in per_round)
                                       for key in ("cupyflash", "cudnn"))  # fmt: skip
                cell += f" ({ours_bwd:.1f}/{cudnn_bwd:.1f})"
            cells.append(cell)
        print(f"  {tree:24}", " ".join(cells))


def ab_host(args: argparse.Namespace) -> None:
    show = lambda row: " ".join(f"{name} {us:.1f}" for name, us in row.items())  # noqa: E731
    results = rounds(args.trees, args.rounds, MEASURE_HOST, [str(args.calls)], show)
    print("medians over rounds (us per call; x = over SDPA's host time in the same processes):")
    for tree, per_round in results.items():
        medians = {name: statistics.median(row[name] for row in per_round) for name in per_round[0]}
        cells = []
        for name, us in medians.items():
            if name.endswith("_sdpa"):
                cells.append(f"{name} {us:.1f}")
            else:
                cells.append(f"{name} {us:.1f} (x{us / medians[name.split('_')[0] + '_sdpa']:.2f})")
        print(f"  {tree:24}", "  ".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    prefill = sub.add_parser("prefill", help="TFLOP/s of prefill shapes, cupyflash and cuDNN")
    prefill.add_argument("trees", nargs="+")
    prefill.add_argument("--rounds", type=int, default=3)
    prefill.add_argument("--shapes", nargs="+", default=["bf16-64-1024-0", "bf16-64-1024-1", "fp16-64-1024-1"])
    train = sub.add_parser("train", help="TFLOP/s of training steps and backwards, cupyflash and cuDNN")
    train.add_argument("trees", nargs="+")
    train.add_argument("--rounds", type=int, default=3)
    train.add_argument("--shapes", nargs="+", default=["bf16-128-4096-0", "bf16-128-4096-1", "bf16-64-4096-0"])
    decode = sub.add_parser("decode", help="microseconds per decode step, cupyflash and cuDNN")
    decode.add_argument("trees", nargs="+")
    decode.add_argument("--rounds", type=int, default=3)
    decode.add_argument("--shapes", nargs="+", default=["1-131072", "32-32768", "64-4096", "1-4096"])
    host = sub.add_parser("host", help="host time per tiny call (prefill, decode), torch and CuPy, beside SDPA")
    host.add_argument("trees", nargs="+")
    host.add_argument("--rounds", type=int, default=5)
    host.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    (ab_host if args.mode == "host" else ab_prefill)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
