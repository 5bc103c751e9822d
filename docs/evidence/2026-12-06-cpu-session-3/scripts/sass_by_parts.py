"""SASS of the score-function variants that the per-row / per-key parts change, on a machine
without a GPU: each built by NVRTC (_kernels.compile_offline) and disassembled by nvdisasm (the
first argument); prints instructions, LDG, BRA and spill bytes. Captured arrays of a real
call's size (4k positions): with 40 entries ptxas folds the reads' bounds.
    usage: PYTHONPATH=<tree> python sass_by_parts.py NVDISASM"""

import collections
import re
import subprocess
import sys

import numpy as np

from cupyflash import _block_mask, _dispatch, _kernels, _mod_tiles, _mods, _plan, mods
from cupyflash._attention import with_implied_bounds
from cupyflash._device import DeviceInfo
from cupyflash._validate import attention_problem

nvdisasm = sys.argv[1]
n, heads = 4096, 16
doc = (np.arange(n) // 700).astype(np.int32)
table = np.zeros((heads, 2 * n), np.float32)
bias = np.zeros((8, 8192), np.float32)
h100 = DeviceInfo(0, "sm_90a", 132, 232448, 233472, 65536, 2048, 32)


def hopper_forward(score_fn, mask_fn):  # as a call of 1 x 4096 x 16 x 128 bf16 plans it
    score_mod = None if score_fn is None else _mods.trace_score_mod(score_fn)
    mask_mod = None if mask_fn is None else _mods.trace_mask_mod(mask_fn)
    kernel = _mods.kernel_mods(score_mod, mask_mod, _mod_tiles.kernel_source(mask_mod))
    shape = (1, n, heads, 128)
    problem = attention_problem(shape, shape, shape, causal=False, scale=None, window=(-1, -1), softcap=0.0,
                                layout="bshd")  # fmt: skip
    problem = with_implied_bounds(problem, mask_mod)
    summary = None if mask_mod is None else _block_mask.implied(mask_mod, 1, heads, n, n)
    cells = None if summary is None else _block_mask.layout(summary)
    (step,) = _plan.plan_attention(problem, "bfloat16", h100, "auto", shape, mods=kernel, cells=cells).steps
    return step.spec


document_causal = _mods.trace_mask_mod(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i))
pair = _mods.kernel_mods(_mods.trace_score_mod(lambda s, b, h, i, j: 20.0 * mods.tanh(s / 20.0) + bias[h, j]),
                         _mods.trace_mask_mod(lambda b, h, i, j: doc[i] == doc[j])).source  # fmt: skip
causal_mods = _dispatch.MaskFlags(True, False, False, mask="mods")
alone = _mods.kernel_mods(None, document_causal).source
document_fn = lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i)  # noqa: E731
relative_fn = lambda s, b, h, i, j: s + table[h, i - j + n]  # noqa: E731
builds = {
    "Hopper fwd, document_causal mask, d128": (hopper_forward(None, document_fn), "sm_90a"),
    "Hopper fwd, relative bias, d128": (hopper_forward(relative_fn, None), "sm_90a"),
}
for d in (64, 128):
    spec = _dispatch.fa3_bwd_spec("bfloat16", d, causal_mods, False, False, alone)
    builds[f"Hopper bwd, document_causal alone, d{d}"] = (spec, "sm_90a")
for d in (64, 128):
    builds[f"mma.sync bwd, softcap+bias[h,j] & doc, d{d}"] = (
        _dispatch.fa2_bwd_spec("bfloat16", d, causal_mods, False, pair),
        "sm_80",
    )
instruction = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9._]+)", re.M)
print(f"{'variant':46s} {'arch':6s} {'instr':>6s} {'LDG':>4s} {'BRA':>4s} {'spill':>5s}")
for name, (spec, arch) in builds.items():
    build = _kernels.compile_offline(spec, arch)
    with open("/tmp/sass_by_parts.cubin", "wb") as f:
        f.write(build.cubin + b"\0")  # (CuPy's getCUBIN drops the trailing NUL nvdisasm reads)
    sass = subprocess.run([nvdisasm, "/tmp/sass_by_parts.cubin"], capture_output=True, text=True).stdout
    ops = collections.Counter(m.group(1).split(".")[0] for m in instruction.finditer(sass))
    print(
        f"{name:46s} {arch:6s} {sum(ops.values()):6d} {ops['LDG']:4d} {ops['BRA']:4d} {build.spill_bytes:5d}",
        flush=True,
    )
