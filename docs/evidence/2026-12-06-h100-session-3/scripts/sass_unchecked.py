"""SASS of the Hopper forward (sm_90a, bf16, non-causal, 4k keys) with a score or mask function,
every captured read checked and with a call's grid (cupyflash._mods.Grid: the reads the call's
index ranges keep inside their arrays unchecked): instructions, the compares and selects the
checks cost, and NVRTC's build time on this machine.

    PYTHONPATH=<tree> python sass_unchecked.py NVDISASM [HEAD_DIM ...]
"""

import collections
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

from cupyflash import _dispatch, _kernels, _mods, mods

N, HEADS = 4096, 32
slopes = np.zeros(HEADS, np.float32)
bias = np.zeros((HEADS, 2 * N), np.float32)
doc = np.zeros(N, np.int32)
FUNCTIONS = {
    "alibi": (lambda s, b, h, i, j: s - slopes[h] * mods.abs(i - j), None),
    "relative bias": (lambda s, b, h, i, j: s + bias[h, i - j + N], None),
    "document": (None, lambda b, h, i, j: doc[i] == doc[j]),
}


def opcodes(cubin: bytes, nvdisasm: str) -> collections.Counter:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin + b"\0")
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    found = collections.Counter()
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            found[m.group(2)] += 1
    return found


def main() -> None:
    nvdisasm, dims = sys.argv[1], [int(x) for x in sys.argv[2:]] or [64, 128]
    print("| function | d | reads | instructions | ISETP | FSEL | LDG | spill | NVRTC s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for head_dim in dims:
        for name, (score_fn, mask_fn) in FUNCTIONS.items():
            score_mod = score_fn and _mods.trace_score_mod(score_fn)
            mask_mod = mask_fn and _mods.trace_mask_mod(mask_fn)
            for label, grid in (("checked", None), ("grid", _mods.Grid(4, HEADS, N, N))):
                source = _mods.kernel_mods(score_mod, mask_mod, grid=grid).source
                flags = _dispatch.MaskFlags(False, False, False)
                spec = _dispatch.fa3_fwd_spec("bfloat16", head_dim, flags, N, mods_source=source)
                start = time.perf_counter()
                build = _kernels.compile_offline(spec, "sm_90a")
                seconds = time.perf_counter() - start
                ops = opcodes(build.cubin, nvdisasm)
                print(
                    f"| {name} | {head_dim} | {label} | {sum(ops.values()):,} | {ops['ISETP']} | {ops['FSEL']} | "
                    f"{ops['LDG']} | {build.spill_bytes} | {seconds:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
