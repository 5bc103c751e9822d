"""Writes kernels_cu/wgmma.cuh: the wgmma.mma_async wrappers of the Hopper forward and backward.

Each wgmma shape names its N/2 fp32 accumulator registers one by one in the PTX string, which
C++ cannot spell with a loop; this script writes them out once (run it after changing SHAPES and
commit the result: the kernels never generate source at run time). tests/test_kernel_sources.py
checks that the committed header is this script's output and that SHAPES is _specs.WGMMA_N.
    python scripts/gen_wgmma.py              # writes kernels_cu/wgmma.cuh
    python scripts/gen_wgmma.py --stdout     # prints it
    python scripts/gen_wgmma.py --output PATH
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# N of m64nNk16: the key blocks (Q K^T) and head dims (P V) of the shipped Hopper tiles
# (_dispatch.FA3_FWD_TILES block_n 64 / 128, FA3_HEAD_DIMS 64 / 128 / 256), and the backward's
# 80-row steps (S^T, dP^T and dQ^T: N = the step's query rows); = _specs.WGMMA_N.
SHAPES = (64, 80, 128, 256)
TYPES = {"__half": "f16", "__nv_bfloat16": "bf16"}
# 8-bit inputs (the FP8 forward): m64nNk32, K-major operands only (wgmma has no transpose for them).
FP8_TYPES = {"__nv_fp8_e4m3": "e4m3"}
FP8_SHAPES = (64, 128, 256)  # the FP8 forward's key blocks and head dims

HEADER = """\
// wgmma.mma_async wrappers (m64nNk16 for 16-bit inputs, m64nNk32 for e4m3; fp32 accumulate),
// written by scripts/gen_wgmma.py.
//
// A warpgroup (4 warps) computes a 64 x N tile; warp w holds rows 16 w .. 16 w + 15 and its
// accumulator d[j][e] is element (row 16 w + lane / 4 + 8 (e / 2), col 8 j + 2 (lane % 4) + e % 2):
// per warp exactly the m16n8 layout of mma.sync, so the mask, softmax and P re-packing of the
// mma.sync kernel apply unchanged.
//   ss(d, desc_a, desc_b, accumulate): A (64 x 16) and B (N x 16) both K-major in shared memory
//                                      (Q K^T: Q and K stored [rows][d]).
//   rs_bt(d, a, desc_b, accumulate):   A from registers (the mma.sync A fragment), B stored
//                                      MN-major (P V: V stored [keys][d], transposed on the fly).
//   ss_tt(d, desc_a, desc_b, accumulate): A and B both MN-major in shared memory (the backward's
//                                      dQ = dS K: dS stored [keys][query rows], K [keys][d]).
//   ss_ta(d, desc_a, desc_b, accumulate): A MN-major, B K-major in shared memory (the backward's
//                                      dQ^T = K^T dS^T: K stored [keys][d], dS [query rows][keys]).
// e4m3 (a k-step is 32 elements: 32 bytes of a row, as for 16-bit inputs) has no transposed
// operand, so both of its forms read B K-major:
//   ss(d, desc_a, desc_b, accumulate): as above (Q K^T);
//   rs(d, a, desc_b, accumulate):      A from registers (4 registers of 4 e4m3: rows g, g + 8,
//                                      columns 4 t .. 4 t + 3 and 16 + 4 t .. 16 + 4 t + 3, for
//                                      lane = 4 g + t), B K-major (P V: V stored transposed, [d][keys]).
// accumulate = 0 overwrites d (first k-step), 1 adds to it.
// clang-format off: the operand lists are laid out by the generator
#pragma once

#include <cuda_fp8.h>

#include "common.cuh"

template <int N, typename Element>
struct Wgmma;
"""


def _regs(first: int, count: int) -> str:
    return ", ".join(f"%{i}" for i in range(first, first + count))


def _acc_operands(n: int) -> str:
    ops = [f'"+f"(d[{j}][{e}])' for j in range(n // 8) for e in range(4)]
    lines = [", ".join(ops[i : i + 8]) for i in range(0, len(ops), 8)]
    return (",\n" + " " * 14).join(lines)


def _asm_bodies(n: int, shape: str, immediates: str, rs_immediates: str) -> tuple[str, str]:
    """The asm statement bodies of the shared-memory form (A and B by descriptor) and the register
    form (A from four registers) of one wgmma shape, ``immediates`` after the scale-d predicate."""
    acc = n // 2
    ss = (
        f'        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc + 2}, 0;\\n"\n'
        f'        "wgmma.mma_async.sync.aligned.{shape} "\n'
        f'        "{{{_regs(0, acc)}}}, "\n'
        f'        "%{acc}, %{acc + 1}, p, {immediates};\\n}}\\n"\n'
        f"        : {_acc_operands(n)}\n"
        f'        : "l"(desc_a), "l"(desc_b), "r"(accumulate));'
    )
    rs = (
        f'        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc + 5}, 0;\\n"\n'
        f'        "wgmma.mma_async.sync.aligned.{shape} "\n'
        f'        "{{{_regs(0, acc)}}}, "\n'
        f'        "{{{_regs(acc, 4)}}}, %{acc + 4}, p, {rs_immediates};\\n}}\\n"\n'
        f"        : {_acc_operands(n)}\n"
        f'        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));'
    )
    return ss, rs


def _method(name: str, n: int, operands: str, body: str) -> str:
    """One wrapper method; all but ``ss`` break before ``int accumulate``, aligned after the "("."""
    head = f"  static CF_DEVICE void {name}("
    gap = " " if name == "ss" else "\n" + " " * len(head)
    return f"{head}float (&d)[{n // 8}][4], {operands},{gap}int accumulate) {{\n    asm volatile(\n{body}\n  }}\n"


def _specialisation(n: int, ctype: str, ptx_type: str) -> str:
    # immediates: scale-a, scale-b, transpose-a, transpose-b (the register form: scale-a, -b, transpose-b)
    ss, rs = _asm_bodies(n, f"m64n{n}k16.f32.{ptx_type}.{ptx_type}", "1, 1, 0, 0", "1, 1, 1")
    ss_tt = ss.replace("p, 1, 1, 0, 0;", "p, 1, 1, 1, 1;")
    ss_ta = ss.replace("p, 1, 1, 0, 0;", "p, 1, 1, 1, 0;")
    return (
        f"template <>\nstruct Wgmma<{n}, {ctype}> {{\n"
        + _method("ss", n, "uint64_t desc_a, uint64_t desc_b", ss)
        + _method("ss_tt", n, "uint64_t desc_a, uint64_t desc_b", ss_tt)
        + _method("ss_ta", n, "uint64_t desc_a, uint64_t desc_b", ss_ta)
        + _method("rs_bt", n, "const uint32_t (&a)[4], uint64_t desc_b", rs)
        + "};\n"
    )


def _fp8_specialisation(n: int, ctype: str, ptx_type: str) -> str:
    # 8-bit inputs take no transpose immediates: scale-a, scale-b only
    ss, rs = _asm_bodies(n, f"m64n{n}k32.f32.{ptx_type}.{ptx_type}", "1, 1", "1, 1")
    return (
        f"template <>\nstruct Wgmma<{n}, {ctype}> {{\n"
        + _method("ss", n, "uint64_t desc_a, uint64_t desc_b", ss)
        + _method("rs", n, "const uint32_t (&a)[4], uint64_t desc_b", rs)
        + "};\n"
    )


DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "kernels_cu" / "wgmma.cuh"


def render() -> str:
    """The text of kernels_cu/wgmma.cuh."""
    parts = [HEADER]
    for n in SHAPES:
        for ctype, ptx_type in TYPES.items():
            parts.append(_specialisation(n, ctype, ptx_type))
        for ctype, ptx_type in FP8_TYPES.items():
            if n in FP8_SHAPES:
                parts.append(_fp8_specialisation(n, ctype, ptx_type))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--stdout", action="store_true", help="print the header instead of writing it")
    where.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write it")
    args = parser.parse_args(argv)
    text = render()
    if args.stdout:
        sys.stdout.write(text)
        return
    args.output.write_text(text)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
