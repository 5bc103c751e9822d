"""SASS of the Hopper forward's variants with score functions beside the built-in options, on a
machine without a GPU: each call is routed with stub_gpu.py up to its launch, its variant built by
NVRTC for sm_90a (_kernels.compile_offline) and disassembled (nvdisasm, given as the first
argument); prints the instruction count and the kinds that differ, and the build's seconds (three
builds, least and most). B = 4, N = 4096, H = 16, d = 128, bf16.
    usage: PYTHONPATH=<tree> python mods_sass.py NVDISASM"""

import collections
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import stub_gpu  # noqa: E402,F401

import torch  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import _block_mask, _kernels, _launch, mods  # noqa: E402

nvdisasm = sys.argv[1]
specs, current = {}, [""]


class Planned(Exception):
    pass


def planned(launch, *args, **kwargs):
    specs[current[0]] = launch.steps[0].spec
    raise Planned


_launch.run = planned
_block_mask.implied_on = lambda *args, **kwargs: None  # (the summary needs a GPU; the variant does not)
q, k, v = (torch.randn(4, 4096, 16, 128).to(torch.bfloat16) for _ in range(3))
cap, slopes = 30.0, torch.rand(16)
doc, bias = torch.arange(4096, dtype=torch.int32) // 700, torch.randn(16, 8192)
cases = {
    "built-in softcap": {"softcap": cap},
    "softcap score_mod": {"score_mod": lambda s, b, h, i, j: cap * mods.tanh(s / cap)},
    "ALiBi score_mod": {"score_mod": lambda s, b, h, i, j: s - slopes[h] * mods.abs(i - j)},
    "relative bias table": {"score_mod": lambda s, b, h, i, j: s + bias[h, i - j + 4096]},
    "built-in causal": {"causal": True},
    "document-causal mask": {"mask_mod": lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i)},
    "sliding-window mask": {"mask_mod": lambda b, h, i, j: (j <= i) & (i - j < 256)},
}
for name, options in cases.items():
    current[0] = name
    try:
        cupyflash.attention(q, k, v, **options)
    except Planned:
        pass
kinds = ("MUFU", "FMUL", "FFMA", "IMAD", "ISETP", "I2F", "LDG", "LDC", "BRA")
print(f"| call | variant | instructions | {' | '.join(kinds)} | registers | NVRTC s |")
print("|---|---|---|" + "---|" * len(kinds) + "---|---|")
for name, spec in specs.items():
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        build = _kernels.compile_offline(spec, "sm_90a")
        seconds.append(time.perf_counter() - start)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        # (CuPy's getCUBIN drops the ELF's last byte when it is 0: nvdisasm wants it back)
        f.write(build.cubin + b"\0" * (len(build.cubin) % 8 != 0))
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    ops = [op.split(".")[0] for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass)]
    count = collections.Counter(ops)
    registers = re.search(r"Used (\d+) registers", build.log).group(1)
    row = " | ".join(str(count[kind]) for kind in kinds)
    print(f"| {name} | {spec.name} | {len(ops)} | {row} | {registers} | {min(seconds):.2f}-{max(seconds):.2f} |")
