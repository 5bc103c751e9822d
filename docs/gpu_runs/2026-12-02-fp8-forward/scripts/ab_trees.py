"""The FP8 forward of source trees (make_ab_tree.sh's: TREE/NAME/ a renamed cupyflash beside its
kernels_cu/) beside this tree's and cuDNN's bf16, in one process under the three timings, d = 128,
B x N = 16k, H = 16, q per tensor and K / V per head.

    python ab_trees.py TREE [TREE ...] [--seqlens N ...]
"""

import argparse
import importlib
import os
import sys

import cupyflash
from cupyflash import bench

parser = argparse.ArgumentParser()
parser.add_argument("trees", nargs="+")
parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
args = parser.parse_args()
modules = {"main": cupyflash}
for tree in args.trees:
    name = next(n for n in os.listdir(tree) if os.path.isfile(os.path.join(tree, n, "_api.py")))
    sys.path.insert(0, tree)
    modules[name] = importlib.import_module(name)

for n in args.seqlens:
    for causal in (False, True):
        shape = bench.PrefillShape(16384 // n, n, 16, 128, causal, "bfloat16")
        q, k, v = bench.prefill_inputs(shape)
        q8, qs = cupyflash.quantize_fp8(q, per="tensor")
        (k8, ks), (v8, vs) = (cupyflash.quantize_fp8(x) for x in (k, v))

        def fp8_call(m, arrays=(q8, k8, v8), descales=(qs, ks, vs), causal=causal):
            q_descale, k_descale, v_descale = descales
            return lambda: m.attention(
                *arrays, causal=causal, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale
            )

        fns = {name: fp8_call(m) for name, m in modules.items()}
        fns["cudnn_bf16"] = bench.sdpa_call("cudnn", q, k, v, causal)
        ref = fns["main"]().float()
        diff = {name: float((fns[name]().float() - ref).abs().max()) for name in modules}
        timings = {
            "single": {name: bench.cuda_time_ms(fn, repeat=30) for name, fn in fns.items()},
            "b2b20": {name: bench.cuda_time_ms(fn, repeat=10, calls=20) for name, fn in fns.items()},
            "interleaved": bench.cuda_times_ms(fns, repeat=30),
        }
        line = f"N={n:5d} causal={int(causal)} max|diff| vs main " + " ".join(f"{a} {b:.2e}" for a, b in diff.items())
        for timing, ms in timings.items():
            line += f" | {timing}: " + " ".join(f"{name} {t * 1e3:7.1f}" for name, t in ms.items()) + " us "
            line += " ".join(f"{name}/main {ms[name] / ms['main']:.3f}" for name in modules if name != "main")
        print(line, flush=True)
