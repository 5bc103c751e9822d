"""A training step (forward + backward) of the Hopper backward's flag variants at d = 64 -- the
ones whose first 128-row build spilled (causal with a window, softcap, deterministic) and the
two defaults -- in the working tree ("new") beside other trees, in one process, under the three
timings of DESIGN.md. No cuDNN: SDPA has no window or softcap.

    python variants_ab.py TREE [TREE ...] [--json OUT]

Each TREE as in ab3.py (make_ab_tree.sh), reported by its package's name.
"""

import argparse
import importlib
import json
import os
import sys

import torch

import cupyflash
from cupyflash import bench

parser = argparse.ArgumentParser()
parser.add_argument("trees", nargs="+")
parser.add_argument("--json")
args = parser.parse_args()
LIBS = {"new": cupyflash}
for tree in args.trees:
    package = next(n for n in os.listdir(tree) if os.path.isfile(os.path.join(tree, n, "_api.py")))
    sys.path.insert(0, tree)
    LIBS[package] = importlib.import_module(package)
print({name: m.__file__ for name, m in LIBS.items()}, flush=True)

# (name, causal, window, softcap, deterministic)
VARIANTS = [
    ("plain", False, (-1, -1), 0.0, False),
    ("causal", True, (-1, -1), 0.0, False),
    ("causal_det", True, (-1, -1), 0.0, True),
    ("causal_local", True, (1024, -1), 0.0, False),
    ("causal_local_det", True, (1024, -1), 0.0, True),
    ("causal_softcap", True, (-1, -1), 30.0, False),
    ("causal_local_softcap_det", True, (1024, -1), 30.0, True),
]
N = 4096
shape = bench.PrefillShape(16384 // N, N, 2048 // 64, 64, False, "bfloat16")
q, k, v = (x.requires_grad_() for x in bench.prefill_inputs(shape))
grad = torch.randn_like(q)

rows = []
for name, causal, window, softcap, det in VARIANTS:
    options = dict(causal=causal, window=window, softcap=softcap, deterministic=det)

    def step(lib, options=options):
        def call():
            q.grad = k.grad = v.grad = None
            lib.attention(q, k, v, **options).backward(grad)

        return call

    fns = {lib_name: step(lib) for lib_name, lib in LIBS.items()}
    grads = {}
    for lib_name, fn in fns.items():
        fn()
        grads[lib_name] = [x.grad.float().clone() for x in (q, k, v)]
    diff = {n: max(float((a - b).abs().max()) for a, b in zip(g, grads["new"])) for n, g in grads.items()}
    timings = {
        "single": {n: bench.cuda_time_ms(fn, repeat=20) for n, fn in fns.items()},
        "b2b20": {n: bench.cuda_time_ms(fn, repeat=5, calls=20) for n, fn in fns.items()},
        "interleaved": bench.cuda_times_ms(fns, repeat=20),
    }
    row = {"variant": name, "max_abs_diff_vs_new": diff}
    line = f"{name:26s}"
    for timing, ms in timings.items():
        row[timing] = {n: round(t * 1e3, 1) for n, t in ms.items()}
        line += f" | {timing}: " + " ".join(f"{n} {t * 1e3:7.1f}" for n, t in ms.items()) + " us"
        line += "".join(f" {n}/new {ms[n] / ms['new']:.3f}" for n in ms if n != "new")
    rows.append(row)
    print(line, "| diff " + " ".join(f"{n} {e:.2e}" for n, e in diff.items()), flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
