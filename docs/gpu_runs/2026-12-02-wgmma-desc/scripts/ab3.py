"""A/B of two cupyflash trees beside cuDNN, in one process, under the three timings of DESIGN.md:
single calls after warm-up, 20 back-to-back calls between two events, bench.py's interleaved
harness. `fwd` times the forward; `train` a training step (forward + backward).

    python ab3.py fwd|train TREE [TREE ...] [--shapes D-N-CAUSAL ...] [--json OUT]

The working tree's cupyflash is "new". Each TREE is a folder holding another cupyflash renamed
after the folder (TREE/NAME/, with its torch op namespace `_LIB` = NAME, so that all register)
beside its kernels_cu/: make_ab_tree.sh writes one. The calls of the first TREE are named
"base" in the report. (This folder's logs were written with one TREE, .ab/base holding
``cfbase``, by two scripts, fwd_ab3.py and bwd_ab3.py, merged here afterwards: the same calls,
timings and report.)
"""

import argparse
import json
import sys

import torch

import cupyflash
from cupyflash import bench

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=("fwd", "train"))
parser.add_argument("trees", nargs="+")
parser.add_argument("--json")
parser.add_argument("--shapes", nargs="+", help="d-N-causal, e.g. 64-1024-0 (default: the mode's list)")
args = parser.parse_args()
import importlib  # noqa: E402
import os  # noqa: E402

OTHERS = {}  # report name -> the tree's package
for i, tree in enumerate(args.trees):
    package = next(n for n in os.listdir(tree) if os.path.isfile(os.path.join(tree, n, "_api.py")))
    sys.path.insert(0, tree)
    OTHERS["base" if i == 0 else package] = importlib.import_module(package)
print("new:", cupyflash.__file__, {name: m.__file__ for name, m in OTHERS.items()}, flush=True)
NAMES = ["new", *OTHERS]
SHAPES = {
    "fwd": [(64, 1024, 0), (64, 1024, 1), (64, 4096, 0), (64, 4096, 1), (128, 1024, 0), (128, 4096, 0),
            (128, 4096, 1), (128, 16384, 0)],
    "train": [(64, 1024, 0), (64, 4096, 1), (128, 1024, 0), (128, 4096, 0), (128, 4096, 1), (128, 16384, 0)],
}[args.mode]
if args.shapes:
    SHAPES = [tuple(int(x) for x in shape.split("-")) for shape in args.shapes]
REPEAT = {"fwd": (30, 10), "train": (20, 5)}[args.mode]  # samples: single / interleaved, back-to-back


def forward_calls(q, k, v, causal):
    """The three forwards and each one's largest difference from cuDNN's output."""
    fns = {name: (lambda m=m: m.attention(q, k, v, causal=causal)) for name, m in [("new", cupyflash), *OTHERS.items()]}
    fns["cudnn"] = bench.sdpa_call("cudnn", q, k, v, causal)
    ref = fns["cudnn"]().transpose(1, 2).float()
    return fns, {name: float((fns[name]().float() - ref).abs().max()) for name in NAMES}


def training_calls(q, k, v, causal):
    """The three training steps and each one's largest difference from cuDNN's gradients."""
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    grad = torch.randn_like(q)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))

    def step(attention):
        def call():
            q.grad = k.grad = v.grad = None
            attention(q, k, v, causal=causal).backward(grad)

        return call

    def cudnn_step():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        qt.grad = kt.grad = vt.grad = None
        out.backward(grad.transpose(1, 2))

    fns = {name: step(m.attention) for name, m in [("new", cupyflash), *OTHERS.items()]}
    fns["cudnn"] = cudnn_step
    grads = {}
    for name in NAMES:
        fns[name]()
        grads[name] = [x.grad.float() for x in (q, k, v)]
    cudnn_step()
    ref = [x.grad.transpose(1, 2).float() for x in (qt, kt, vt)]
    return fns, {name: max(float((a - b).abs().max()) for a, b in zip(g, ref)) for name, g in grads.items()}


rows = []
for d, n, causal in SHAPES:
    shape = bench.PrefillShape(16384 // n, n, 2048 // d, d, bool(causal), "bfloat16")
    calls = forward_calls if args.mode == "fwd" else training_calls
    fns, err = calls(*bench.prefill_inputs(shape), bool(causal))
    timings = {
        "single": {name: bench.cuda_time_ms(fn, repeat=REPEAT[0]) for name, fn in fns.items()},
        "b2b20": {name: bench.cuda_time_ms(fn, repeat=REPEAT[1], calls=20) for name, fn in fns.items()},
        "interleaved": bench.cuda_times_ms(fns, repeat=REPEAT[0]),
    }
    row = {"d": d, "n": n, "causal": causal, "max_abs_diff_vs_cudnn": err}
    line = f"d={d:3d} N={n:5d} causal={causal}"
    for timing, ms in timings.items():
        row[timing] = {name: round(t * 1e3, 1) for name, t in ms.items()}
        line += f" | {timing}: " + " ".join(f"{name} {ms[name] * 1e3:7.1f}" for name in [*NAMES, "cudnn"]) + " us"
        line += "".join(f" {name}/cudnn {ms['cudnn'] / ms[name]:.3f}" for name in NAMES)
    rows.append(row)
    print(line, "| err " + " ".join(f"{name} {e:.2e}" for name, e in err.items()), flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
