"""SASS of the Hopper kernels with a mask_mod alone beside the built-in path, on a machine without a
GPU: each variant built by NVRTC for sm_90a (_kernels.compile_offline) and disassembled (nvdisasm,
the first argument); prints the instruction count and a few kinds. bf16, d = 128, no causal
variant (a mask with a BlockMask runs the unbounded one).
    usage: PYTHONPATH=<tree> python sass_mask_alone.py NVDISASM"""

import collections
import re
import subprocess
import sys

import numpy as np

from cupyflash import _dispatch, _kernels, _mods

nvdisasm = sys.argv[1]
doc = np.zeros(40, np.int32)
plain = _dispatch.MaskFlags(False, False, False)
masked = _dispatch.MaskFlags(False, False, False, mask="mods")
cases = {
    "causal mask_mod": _mods.kernel_mods(None, _mods.trace_mask_mod(lambda b, h, i, j: j <= i)).source,
    "document mask_mod": _mods.kernel_mods(None, _mods.trace_mask_mod(lambda b, h, i, j: doc[i] == doc[j])).source,
}
specs = {n: _dispatch.fa3_fwd_spec("bfloat16", 128, plain, 8192, mods_source=s) for n, s in cases.items()}
specs["built-in, no mask"] = _dispatch.fa3_fwd_spec("bfloat16", 128, plain, 8192)
for n, s in cases.items():
    specs[n + " bwd"] = _dispatch.fa3_bwd_spec("bfloat16", 128, masked, False, False, s)
specs["built-in bwd"] = _dispatch.fa3_bwd_spec("bfloat16", 128, plain, False, False)
instruction = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9._]+)", re.M)
for name, spec in specs.items():
    build = _kernels.compile_offline(spec, "sm_90a")
    with open("/tmp/sass_mask_alone.cubin", "wb") as f:
        f.write(build.cubin + b"\0")  # (CuPy's getCUBIN drops the trailing NUL nvdisasm reads)
    sass = subprocess.run([nvdisasm, "/tmp/sass_mask_alone.cubin"], capture_output=True, text=True).stdout
    ops = collections.Counter(m.group(1).split(".")[0] for m in instruction.finditer(sass))
    kinds = " ".join(f"{k} {ops[k]}" for k in ("FMUL", "ISETP", "FSEL", "LDG"))
    print(f"{name:24s} {sum(ops.values()):6d}  {kinds}  spill {build.spill_bytes}")
