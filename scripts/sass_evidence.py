"""SASS evidence for kernel variants: compile each rendered variant with nvcc (-cubin, ptxas -v)
and count, in cuobjdump's SASS, the tensor-core and copy instructions and any local-memory
traffic (LDL/STL = spills). Needs nvcc and cuobjdump on PATH.
    python scripts/sass_evidence.py [--arch sm_90a] [--all]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash._dispatch import all_fa2_fwd_specs, all_fa3_fwd_specs  # noqa: E402
from cupyflash._source import render  # noqa: E402

OPCODES = ("HGMMA", "HMMA", "UTMALDG", "LDGSTS", "LDSM", "SYNCS", "USETMAXREG", "LDL", "STL")


def evidence(spec, arch: str) -> dict[str, object]:
    code, options, name = render(spec)
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / f"{name}.cu", Path(tmp) / f"{name}.cubin"
        src.write_text(code)
        build = subprocess.run(
            ["nvcc", "-cubin", f"-arch={arch}", *options, "-Xptxas", "-v", str(src), "-o", str(cubin)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    counts = collections.Counter(op for op in re.findall(r"\b([A-Z][A-Z0-9]+)(?=[ .])", sass) if op in OPCODES)
    regs = re.search(r"Used (\d+) registers", build.stderr)
    spills = re.search(r"(\d+) bytes spill stores", build.stderr)
    return {
        "variant": name,
        "arch": arch,
        "registers": int(regs.group(1)) if regs else None,
        "spill_store_bytes": int(spills.group(1)) if spills else None,
        **{op: counts.get(op, 0) for op in OPCODES},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--all", action="store_true", help="every variant, not one per kernel and head dim")
    args = parser.parse_args(argv)
    specs = [*all_fa3_fwd_specs(), *all_fa2_fwd_specs()]
    if not args.all:  # the plain (non-causal, no window, no softcap) variant of each kernel/head dim/dtype
        specs = [s for s in specs if not (s.causal or s.local or s.softcap) and s.dtype == "bfloat16"]
    print(" ".join(f"{c:>10}" for c in ("regs", "spill_B", *OPCODES)), " variant")
    for spec in specs:
        row = evidence(spec, args.arch)
        cells = [row["registers"], row["spill_store_bytes"], *(row[op] for op in OPCODES)]
        print(" ".join(f"{c!s:>10}" for c in cells), "", row["variant"], flush=True)


if __name__ == "__main__":
    main()
